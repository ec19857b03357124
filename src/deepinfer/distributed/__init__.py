"""Beyond one device: expert placement and load balancing (``eplb``), tensor parallelism for
the Llama family (``tensor_parallel``), expert parallelism for DeepSeek MoE layers
(``expert_parallel``), the worker processes and process group that run the extra ranks
(``workers``), and whole engines as data-parallel replicas on one machine (``replicas``)."""
