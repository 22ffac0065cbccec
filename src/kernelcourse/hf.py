"""The course's attention as a drop-in for Hugging Face transformers (introduced in chapter 09).

``register()`` adds the name ``"kernelcourse"`` to transformers' ``AttentionInterface``, so that any model
that dispatches its attention through that interface (Llama, Mistral, Qwen, Gemma and most decoders of
transformers 5) runs the course's FlashAttention with ``attn_implementation="kernelcourse"``::

    import kernelcourse.hf
    kernelcourse.hf.register()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="kernelcourse")  # or .from_pretrained

The same name goes into ``AttentionMaskInterface`` with SDPA's mask function: transformers skips building
a mask for a name missing there, and the attention would then get ``attention_mask=None`` for a padded
batch and silently attend to the padding. With SDPA's mask function, a batch without padding still
gets ``None`` (the kernel's own causal mask covers it) and a padded one gets a mask tensor, which
``attention_forward`` refuses with a ``ValueError``: the kernels take no mask tensor.

Grouped-query attention: ``key`` and ``value`` arrive with ``H_kv`` heads, fewer than the query's ``H``;
they go to ``kernelcourse.attention_backward.attention`` as they are, and query head ``h`` reads key head
``h // (H // H_kv)``, with no copy of the keys per query head (``repeat_kv``).

transformers is imported here only, when ``register()`` runs: the course's package does not need it.
"""
from __future__ import annotations

import copy
import warnings

import torch

from .attention_backward import attention

# transformers imports tqdm.auto on first use, which warns in a notebook without ipywidgets (a page of the
# course would show that warning); the course shows no progress bars. Set before any import of transformers.
warnings.filterwarnings("ignore", message="IProgress not found")

NAME = "kernelcourse"

SUPPORTS = ("supported: no mask tensor (a causal decoder without padding, or full attention), "
            "no dropout, no sliding window, no soft-capping, no attention sinks, no position bias")


def attention_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """An ``AttentionInterface`` function: ``query`` (B, H, N_Q, d), ``key`` and ``value`` (B, H_kv, N_K, d)
    in, ``(output (B, N_Q, H, d), None)`` out (no attention weights: FlashAttention never holds them).

    Causal when the module says so (``module.is_causal``, or ``is_causal`` when the model passes it) and
    there is more than one query; one query (a decoding step) attends to every key in the cache. Raises
    ``ValueError`` for anything the kernels cannot honour, saying what it got: never a silently wrong result.
    """
    if dropout:
        raise ValueError(f"kernelcourse attention got dropout={dropout}: its kernels have no dropout; "
                         f"set the model's attention_dropout to 0 ({SUPPORTS})")
    for name in ("softcap", "sliding_window", "s_aux", "position_bias"):
        if kwargs.get(name) is not None:
            raise ValueError(f"kernelcourse attention got {name}={_describe(kwargs[name])}: its kernels do not "
                             f"implement it ({SUPPORTS})")
    if kwargs.get("output_attentions"):
        raise ValueError("kernelcourse attention cannot return attention weights (output_attentions=True): "
                         "FlashAttention never holds them; use attn_implementation='eager' for that")
    if attention_mask is not None:
        raise ValueError(f"kernelcourse attention got an attention mask {_describe(attention_mask)}: its kernels "
                         "take no mask tensor, so padding, packed sequences and custom masks cannot be honoured; "
                         f"pass a batch without padding ({SUPPORTS})")
    if query.ndim != 4 or key.ndim != 4 or value.ndim != 4:
        raise ValueError(f"kernelcourse attention expects (B, H, N, d) tensors, got query {tuple(query.shape)}, "
                         f"key {tuple(key.shape)}, value {tuple(value.shape)}")
    if query.shape[1] % key.shape[1]:
        raise ValueError(f"{query.shape[1]} query heads cannot share {key.shape[1]} key/value heads: grouped-query "
                         "attention needs the number of query heads to be a multiple of the key/value heads")
    causal = getattr(module, "is_causal", True) if is_causal is None else bool(is_causal)
    n_q, n_k = query.shape[2], key.shape[2]
    causal = causal and n_q > 1
    if causal and n_k != n_q:
        raise ValueError(f"kernelcourse attention got {n_q} queries against {n_k} cached keys with a causal mask: "
                         "its causal mask is aligned top-left, which is right only when the queries are the keys "
                         "(no cache, or one query per step)")
    out = attention(query, key, value, causal=causal, sm_scale=scaling)  # (B, H, N_Q, d)
    return out.transpose(1, 2).contiguous(), None


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"(a {x.dtype} tensor of shape {tuple(x.shape)})"
    return repr(x)


def register(name: str = NAME) -> str:
    """Register the course's attention with transformers under ``name``; returns the name.

    Registers ``attention_forward`` with ``AttentionInterface`` and SDPA's mask function with
    ``AttentionMaskInterface`` (so that a padded batch reaches the attention as a mask, and is refused).
    Calling it again does nothing new.
    """
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError as exc:
        raise ImportError("kernelcourse.hf needs Hugging Face transformers 5: pip install 'transformers>=5'") from exc
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


def tiny_llama_config(**overrides):
    """A small ``LlamaConfig`` for tests and the chapter's examples: random weights, nothing downloaded.

    2 layers of width 64, 4 query heads of dimension 16 sharing 2 key/value heads, a vocabulary of 128.
    """
    from transformers import LlamaConfig

    base = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                attention_dropout=0.0, tie_word_embeddings=False)
    return LlamaConfig(**{**base, **overrides})


def llama_pair(config, dtype=torch.float32, device="cpu", seed: int = 0):
    """Two causal language models of ``config`` (``LlamaForCausalLM`` for a ``LlamaConfig``) with the same random weights: SDPA's attention and the course's."""
    from transformers import AutoModelForCausalLM

    register()
    models = {}
    for impl in ("sdpa", NAME):
        torch.manual_seed(seed)
        # from_config writes the attention's name into the config it gets: each model gets its own copy
        models[impl] = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=impl).to(device=device, dtype=dtype)
    models[NAME].load_state_dict(models["sdpa"].state_dict())
    return models


def train_losses(model, *, steps: int, batch: int, seq_len: int, lr: float = 3e-3, seed: int = 0,
                 vocab: int | None = None, autocast_dtype=None) -> list[float]:
    """Train ``model`` for ``steps`` AdamW steps on random token sequences with a learnable pattern (each
    sequence counts up from a random start, modulo the vocabulary); returns the losses. Same seed, same data."""
    vocab = vocab or model.config.vocab_size
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    model.train()
    for _ in range(steps):
        start = torch.randint(0, vocab, (batch, 1), generator=gen)
        ids = ((start + torch.arange(seq_len)) % vocab).to(device)
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def bench_llama_training(batch: int = 4, seq_len: int = 2048, layers: int = 6, width: int = 768, heads: int = 12,
                         kv_heads: int = 4, steps: int = 20, train_steps: int = 100) -> list[dict]:
    """On a GPU: a Llama of ``layers`` layers of width ``width`` in bfloat16 (float16 before compute capability
    8.0) trained with SDPA's attention and with the course's, same weights and data: tokens per second of a
    training step (forward, backward, AdamW; median of ``steps`` timed steps after warm-up, each step's time
    kept) and the loss curve of ``train_steps`` steps, twice from the same weights and data (``losses`` and
    ``losses_again``: how far a run differs from itself is the yardstick for the gap between the two
    attentions). One row per attention."""
    import statistics
    import time

    from .world import low_precision_dtype

    dtype = low_precision_dtype()
    config = tiny_llama_config(vocab_size=8192, hidden_size=width, intermediate_size=4 * width,
                               num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                               max_position_embeddings=seq_len)
    rows = []
    for impl, model in llama_pair(config, dtype=dtype, device="cuda").items():
        start = copy.deepcopy(model.state_dict())
        losses = train_losses(model, steps=train_steps, batch=batch, seq_len=seq_len, lr=1e-3)
        model.load_state_dict(start)
        losses_again = train_losses(model, steps=train_steps, batch=batch, seq_len=seq_len, lr=1e-3)
        del start
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(0, config.vocab_size, (batch, seq_len), generator=gen).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        times = []
        for i in range(steps + 3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            if i >= 3:
                times.append(time.perf_counter() - t0)
        ms = statistics.median(times) * 1e3
        rows.append({"attention": impl, "ms_per_step": ms, "tokens_per_s": batch * seq_len / (ms * 1e-3),
                     "ms_steps": [t * 1e3 for t in times], "losses": losses, "losses_again": losses_again,
                     "batch": batch, "seq_len": seq_len, "layers": layers, "width": width,
                     "heads": heads, "kv_heads": kv_heads, "dtype": str(dtype).removeprefix("torch.")})
        del model, opt
        torch.cuda.empty_cache()
    return rows
