from kvpool_operator.cli import main

main()
