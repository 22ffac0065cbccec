"""Chapter 09's Hugging Face drop-in (``kernelcourse.hf``): a small Llama built from a config (random weights,
nothing downloaded) with ``attn_implementation="kernelcourse"`` against the same model with SDPA, in float32
on the CPU (kernels in Triton's interpreter): logits and every gradient match; a mask the kernels cannot
honour raises a ValueError instead of a silently wrong result.

The tests named ``test_gqa_*`` need grouped-query attention in ``kernelcourse.attention_backward.attention``
(k and v with fewer heads than q); while the kernels lack it they are expected failures, and they run
for real as soon as it is there.
"""
import pytest
import torch

transformers = pytest.importorskip("transformers")

import kernelcourse as kc  # noqa: E402
from kernelcourse import hf  # noqa: E402

B, N = 2, 24
# float32 on the CPU: the two attentions differ by rounding. On a GPU, Triton's float32 tl.dot rounds its
# inputs to TF32 (10 bits of mantissa), SDPA's float32 kernels do not.
GPU = kc.world().gpu
TOL = dict(rtol=2e-2, atol=2e-3) if GPU else dict(rtol=1e-4, atol=1e-4)
GRAD_TOL = dict(rtol=5e-2, atol=2e-3) if GPU else dict(rtol=1e-4, atol=1e-5)



def forward_backward(model, ids, **kwargs):
    for p in model.parameters():
        p.grad = None
    out = model(input_ids=ids, labels=ids, **kwargs)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def assert_models_agree(kv_heads):
    models = hf.llama_pair(hf.tiny_llama_config(num_key_value_heads=kv_heads), device=kc.world().device)
    torch.manual_seed(1)
    ids = torch.randint(0, 128, (B, N), device=kc.world().device)
    ref_logits, ref_grads = forward_backward(models["sdpa"], ids)
    logits, grads = forward_backward(models["kernelcourse"], ids)
    torch.testing.assert_close(logits, ref_logits, **TOL)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], **GRAD_TOL, msg=lambda m, n=name: f"{n}: {m}")


def test_register_puts_the_name_in_both_interfaces():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    assert hf.register() == "kernelcourse"
    assert AttentionInterface._global_mapping["kernelcourse"] is hf.attention_forward
    # without a mask function under the same name, a padded batch would reach the attention with no mask
    assert "kernelcourse" in AttentionMaskInterface._global_mapping


def test_logits_and_gradients_match_sdpa():
    assert_models_agree(kv_heads=4)


def test_gqa_logits_and_gradients_match_sdpa():
    assert_models_agree(kv_heads=2)


def test_gqa_training_losses_match_sdpa():
    models = hf.llama_pair(hf.tiny_llama_config(), device=kc.world().device)
    losses = {impl: hf.train_losses(m, steps=3, batch=2, seq_len=16) for impl, m in models.items()}
    assert losses["kernelcourse"] == pytest.approx(losses["sdpa"], rel=1e-2 if GPU else 1e-4)


def test_keys_and_values_reach_the_kernel_with_their_own_heads(monkeypatch):
    """Grouped-query attention: the adapter passes k and v with H_kv heads, never repeated per query head."""
    from kernelcourse import attention as A

    seen = []

    def recording(q, k, v, causal=False, sm_scale=None):
        seen.append((tuple(q.shape), tuple(k.shape), causal))
        group = q.shape[1] // k.shape[1]  # query head h reads key head h // group
        k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
        return A.attention_ref(q, k, v, causal=causal, sm_scale=sm_scale)

    monkeypatch.setattr(hf, "attention", recording)
    models = hf.llama_pair(hf.tiny_llama_config(), device=kc.world().device)
    ids = torch.randint(0, 128, (B, N), device=kc.world().device)
    with torch.no_grad():
        got, want = models["kernelcourse"](input_ids=ids).logits, models["sdpa"](input_ids=ids).logits
    assert seen == [((B, 4, N, 16), (B, 2, N, 16), True)] * 2  # two layers, 4 query heads, 2 key/value heads
    torch.testing.assert_close(got, want, **TOL)


def test_padded_batch_raises():
    models = hf.llama_pair(hf.tiny_llama_config(num_key_value_heads=4), device=kc.world().device)
    ids = torch.randint(0, 128, (B, N), device=kc.world().device)
    mask = torch.ones(B, N, dtype=torch.long, device=ids.device)
    mask[1, :5] = 0  # the second sequence is left-padded
    with pytest.raises(ValueError, match="attention mask .*padding"):
        models["kernelcourse"](input_ids=ids, attention_mask=mask)
    # a mask without padding is no mask: the kernels' own causal mask covers it
    with torch.no_grad():
        got = models["kernelcourse"](input_ids=ids, attention_mask=torch.ones_like(mask)).logits
        want = models["sdpa"](input_ids=ids, attention_mask=torch.ones_like(mask)).logits
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("kwargs, match", [
    (dict(dropout=0.1), "dropout"),
    (dict(sliding_window=8), "sliding_window"),
    (dict(softcap=30.0), "softcap"),
    (dict(attention_mask=torch.ones(1, 1, 8, 8, dtype=torch.bool)), "attention mask"),
])
def test_what_the_kernels_cannot_honour_raises(kwargs, match):
    q = k = v = torch.randn(1, 2, 8, 16, device=kc.world().device)
    args = {"attention_mask": None, **kwargs}
    with pytest.raises(ValueError, match=match):
        hf.attention_forward(torch.nn.Module(), q, k, v, **args)


def test_non_causal_module_and_layout():
    """A module that is not causal gets full attention; the output comes back as (B, N, H, d)."""
    from kernelcourse.attention import attention_ref

    module = torch.nn.Module()
    module.is_causal = False
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 20, 16, device=kc.world().device) for _ in range(3))
    out, weights = hf.attention_forward(module, q, k, v, None, scaling=0.3)
    assert weights is None and out.shape == (2, 20, 3, 16)
    torch.testing.assert_close(out, attention_ref(q, k, v, causal=False, sm_scale=0.3).transpose(1, 2), **TOL)


@pytest.mark.skipif(GPU, reason="on a GPU, TF32 rounding in the kernel can flip a near-tie between two tokens")
def test_generation_matches_sdpa():
    """Greedy decoding with a cache: a prefill (queries are the keys) and one-query steps (every key)."""
    models = hf.llama_pair(hf.tiny_llama_config(num_key_value_heads=4), device=kc.world().device)
    ids = torch.randint(0, 128, (1, 10), device=kc.world().device)
    outs = {impl: m.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0) for impl, m in models.items()}
    assert torch.equal(outs["kernelcourse"], outs["sdpa"])
