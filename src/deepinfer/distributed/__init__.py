"""Beyond one device: expert placement and load balancing (``eplb``), tensor parallelism for
the Llama family (``tensor_parallel``), expert parallelism for DeepSeek MoE layers
(``expert_parallel``), and the worker processes and process group that run the extra ranks
(``workers``)."""
