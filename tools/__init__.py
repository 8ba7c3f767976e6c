"""What no node runs: the demo, the simulator, chaos, reports, harnesses, local training, the WAN proxy, fuzzers.

tools/ may import anything; nothing imports tools/ except the CLI's subcommand dispatch (node/__main__.py).
"""
