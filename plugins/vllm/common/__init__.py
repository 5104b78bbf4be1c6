"""What the three vLLM integrations share: settings, namespace, layer numbering and
logging (``settings``), the copies between paged KV blocks and the ring (``copy``), the
ring pinned for CUDA (``cuda_ring``) and the guard in front of vLLM APIs (``vllm_api``)."""
