import jax
from flax import nnx

# The smallest run of ``python -m models.train`` (seconds on CPU): the flags every test of the
# training command line passes besides its preset or init, steps and output directory.
TINY_TRAINING_ARGS = (
    "--batch",
    "2",
    "--seq-len",
    "32",
    "--eval-every",
    "1",
    "--eval-batches",
    "1",
    "--max-corpus-bytes",
    "40000",
    "--attn-impl",
    "xla",
)


def jit_model(model):
    """``model``'s forward as one jitted function of (tokens, positions, segment_ids, cache,
    logits_at, return_hidden):
    eager calls re-trace the XLA attention loops on every call, which is slow on CPU."""
    graphdef, state = nnx.split(model)

    def run(state, tokens, positions, segment_ids, cache, logits_at, return_hidden):
        model = nnx.merge(graphdef, state)
        return model(
            tokens,
            positions,
            segment_ids=segment_ids,
            cache=cache,
            logits_at=logits_at,
            return_hidden=return_hidden,
        )

    run = jax.jit(run, static_argnums=6)

    def call(
        tokens, positions=None, *, segment_ids=None, cache=None, logits_at=None, return_hidden=False
    ):
        return run(state, tokens, positions, segment_ids, cache, logits_at, return_hidden)

    call.config = model.config
    return call


def write_gguf_like_llama_cpp(hf, checkpoint, path, *, tensor_type="F32"):
    """Writes the Hugging Face model ``hf`` (saved at ``checkpoint``) as a GGUF file the way
    llama.cpp's ``convert_hf_to_gguf.py`` does, for the ``llama``, ``qwen3`` and ``gemma3``
    architectures: its metadata keys only (Gemma 3: no layer pattern, local RoPE base or
    attention scale), tensor names from ``gguf.TensorNameMap``, Q/K rows permuted for ``llama``
    (GPT-J pairing), Gemma's norm weights stored as ``1 + w``, Llama-3 RoPE scaling as a
    ``rope_freqs`` tensor of per-frequency divisors, no ``output.weight`` when tied. Written
    independently of ``models.gguf`` so that the reader is tested against another writer.
    Returns ``path``."""
    import math

    import gguf
    import numpy as np
    import safetensors.numpy

    c = hf.config
    arch = {"llama": "llama", "qwen3": "qwen3", "gemma3_text": "gemma3"}[c.model_type]
    tensors = safetensors.numpy.load_file(f"{checkpoint}/model.safetensors")
    writer = gguf.GGUFWriter(str(path), arch)
    D = c.head_dim
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_key_length(D)
    writer.add_value_length(D)
    rope = c.rope_parameters
    if arch == "gemma3":
        rope = rope["full_attention"]
        writer.add_sliding_window(c.sliding_window)
    writer.add_rope_freq_base(rope["rope_theta"])
    if arch == "llama":
        writer.add_rope_dimension_count(D)
    type_id = gguf.GGMLQuantizationType[tensor_type]
    names = gguf.TensorNameMap(gguf.MODEL_ARCH[arch.upper()], c.num_hidden_layers)
    heads = {"q_proj": c.num_attention_heads, "k_proj": c.num_key_value_heads}
    for name, w in tensors.items():
        w = np.asarray(w, np.float32)
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        proj = name.split(".")[-2]
        if arch == "llama" and proj in heads:  # llama.cpp's LlamaModel.permute
            n = heads[proj]
            w = w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
        if arch == "gemma3" and name.endswith("norm.weight"):
            w = w + 1.0
        gname = names.get_name(name.removesuffix(".weight")) + ".weight"
        kind = type_id if w.ndim == 2 else gguf.GGMLQuantizationType.F32
        data = w if kind == gguf.GGMLQuantizationType.F32 else gguf.quants.quantize(w, kind)
        writer.add_tensor(gname, data, raw_dtype=kind)
    if rope.get("rope_type") == "llama3":  # llama.cpp's LlamaModel.generate_extra_tensors
        base, factor = rope["rope_theta"], rope["factor"]
        low, high = rope["low_freq_factor"], rope["high_freq_factor"]
        old = rope["original_max_position_embeddings"]
        writer.add_rope_scaling_orig_ctx_len(old)
        divisors = []
        for freq in 1.0 / (base ** (np.arange(0, D, 2, dtype=np.float32) / D)):
            wavelen = 2 * math.pi / freq
            if wavelen < old / high:
                divisors.append(1.0)
            elif wavelen > old / low:
                divisors.append(factor)
            else:
                smooth = (old / wavelen - low) / (high - low)
                divisors.append(1 / ((1 - smooth) / factor + smooth))
        writer.add_tensor("rope_freqs.weight", np.asarray(divisors, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
