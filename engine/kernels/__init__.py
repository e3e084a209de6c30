"""Triton kernels of the GPU engine, one op per module, each beside its torch reference.

    rmsnorm.py                 rms_norm, add_rms_norm_ (fused residual add, in place)
    rope.py                    rope_cos_sin, apply_rope_ (in place, Llama-3 scaling)
    silu_mul.py                silu_mul (SiLU(gate) * up)
    kv_cache_write.py          write_kv_cache_ (scatter a step's K/V at a slot mapping)
    rope_kv_write.py           rope_write_kv_ (RoPE + the KV-cache write in one kernel)
    paged_decode_attention.py  paged_decode_attention (block tables, GQA, split-K)
    prefill_attention.py       prefill_attention (chunked prefill over a cached prefix)

Each module has `<op>_reference` (the torch path, the CPU path), `<op>_triton` (the
kernel), and `<op>` which picks Triton for CUDA tensors (see backend.py). Nothing is
imported here, so importing one op does not pull in the others.
"""
