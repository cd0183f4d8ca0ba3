"""The operator's test harness, one for both tiers that run the real operator:

- tests/operator: kmock, a Kubernetes API emulator, and the operator in threads of the test process
  (emulator.py), with real AdmissionReviews sent to its webhook (webhooks.py);
- tests/k8s: a real control plane (controlplane.py) with its service network (servicenet.py), the
  chart installed by helm and the operator run as the chart's pod (operatorkit.py), and pods run by a
  kubelet stand-in (kubelet.py).

What both read and write, pools, paths, conditions, Secrets, kubeconfigs, is in objects.py.
"""
