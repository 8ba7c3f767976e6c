"""The pipeline axis: the driver that walks microbatches through stage replicas, replica choice, rerouting, rebalancing."""
