"""kvpool's demo and the tools the bench and the engine tests share: a random-weight tiny model
maker, a runner for vLLM's engine, local servers, an OpenAI-API driver and the workloads. Nothing
here goes into a vLLM image: the connector package holds only what vLLM loads."""
