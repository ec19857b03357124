"""Beyond one device: expert placement and load balancing (EPLB) so far; process groups,
workers and the tensor/expert-parallel collectives are still to come (issue 19)."""
