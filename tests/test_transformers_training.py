"""Training through the transformers backend (issue 46): a training step of tiny random-weight
Llama, Gemma-2 (a sliding window and a logit softcap, ``query_pre_attn_scalar``) and gpt-oss (sinks,
whose ``s_aux`` take a gradient) gives every parameter the gradient eager attention gives, to
1e-4 in float32; a left- or right-padded batch and packed sequences too. What the fused backward
does not build yet raises by name at ``backward()``."""
import pytest

torch = pytest.importorskip("torch")

from conftest import LazyModule  # noqa: E402

#: imported by the first test that runs here, not at collection (conftest.LazyModule)
transformers = LazyModule("transformers")
if not transformers.available:
    pytest.skip("transformers is not installed (the [hf] extra)", allow_module_level=True)

from tvm_attention.integrations import transformers as hf  # noqa: E402

VOCAB = 128

#: family -> (model class, config class, config overrides)
FAMILIES = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", dict(num_hidden_layers=2)),
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config",
               dict(num_hidden_layers=2, sliding_window=8, attn_logit_softcapping=5.0, query_pre_attn_scalar=16)),
    "gpt_oss": ("GptOssForCausalLM", "GptOssConfig",
                dict(num_hidden_layers=2, sliding_window=8, num_local_experts=4, num_experts_per_tok=2)),
}


@pytest.fixture(scope="module")
def mine(tmp_path_factory):
    """The file's register(cache_dir=): the training path's backward artifacts go there too."""
    return tmp_path_factory.mktemp("mine")


@pytest.fixture(autouse=True)
def _backend(tmp_path, monkeypatch, mine):
    monkeypatch.setenv("TVM_ATTENTION_CACHE_DIR", str(tmp_path))
    hf.register(cache_dir=mine)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: PyTorch's parallel regions cost more than their work
    yield
    torch.set_num_threads(threads)


def tiny(family, attn):
    cls_name, config_name, kw = FAMILIES[family]
    conf = getattr(transformers, config_name)(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                              num_key_value_heads=2, head_dim=16, vocab_size=VOCAB,
                                              max_position_embeddings=256, **kw)
    torch.manual_seed(0)
    model = getattr(transformers, cls_name)(conf).to(torch.float32).train()
    if hasattr(model.model.layers[0].self_attn, "sinks"):  # gpt-oss's sinks start at zero: make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_()
    model.set_attn_implementation(attn)
    return model


def grads(model, ids, mask=None, **kw):
    """The loss and every parameter's gradient. Padding: no label for a pad token nor for the
    first real one after left padding (the last pad row predicts it: pad rows output zeros here,
    something in eager, and no real token reads them)."""
    labels = ids if mask is None else ids.masked_fill((mask == 0) | (mask.cumsum(1) == 1), -100)
    model.zero_grad()
    loss = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False, **kw).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_grads(family, ids, mask=None, **kw):
    loss, got = grads(tiny(family, "tvm_attention"), ids, mask, **kw)
    want_loss, want = grads(tiny(family, "eager"), ids, mask, **kw)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-5)
    assert got.keys() == want.keys()
    assert any("sinks" in n for n in got) == (family == "gpt_oss")
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-4, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_training_step_gradients_equal_eager(family, mine, tmp_path):
    """20 tokens: past the sliding layers' window of 8. The backward's artifacts are cached in
    register(cache_dir=)'s folder, not the default one. The process's memo of backward kernels is
    emptied first: another test of this worker may have built the same spec elsewhere."""
    from tvm_attention import torch as tvma_torch

    tvma_torch._pair.cache_clear()
    ids = torch.randint(1, VOCAB, (2, 20), generator=torch.Generator().manual_seed(1))
    calls = hf.stats()["calls"]
    assert_same_grads(family, ids)
    assert hf.stats()["calls"] == calls + 2  # both layers ran ours
    assert list((mine / "backward").glob("*/manifest.json")) and not (tmp_path / "backward").exists()


@pytest.mark.parametrize("padding", ["left", "right"])
def test_padded_training_batch_gradients_equal_eager(padding):
    """Left padding runs kv_start, right padding the key-mask modifier (mask_mod over the 2D
    mask's columns)."""
    ids = torch.randint(1, VOCAB, (2, 14), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0 if padding == "left" else 1
    mask[1, -5:] = 0 if padding == "right" else 1
    assert_same_grads("llama", ids.masked_fill(mask == 0, 0), mask)


def test_packed_sequences_training_gradients_equal_eager():
    """Two documents packed in each row (position_ids restart): transformers' packed-sequence
    mask, run as custom mask bits."""
    ids = torch.randint(1, VOCAB, (2, 16), generator=torch.Generator().manual_seed(4))
    pos = torch.tensor([list(range(7)) + list(range(9)), list(range(10)) + list(range(6))])
    assert_same_grads("llama", ids, position_ids=pos)


@pytest.mark.parametrize("family", ["llama"])  # bf16 with a softcap and sinks: test_torch_attention
def test_bfloat16_training_gradients_are_as_close_as_eagers(family):
    """A bf16 model: our gradients' distance to eager's float32 gradients is within twice eager's
    own bf16 distance (each parameter's gradient, relative to its size)."""
    ids = torch.randint(1, VOCAB, (2, 20), generator=torch.Generator().manual_seed(5))
    _, exact = grads(tiny(family, "eager"), ids)
    calls = hf.stats()["calls"]
    _, ours = grads(tiny(family, "tvm_attention").to(torch.bfloat16), ids)
    assert hf.stats()["calls"] == calls + 2
    _, peer = grads(tiny(family, "eager").to(torch.bfloat16), ids)
    for name, w in exact.items():
        size = w.abs().max()
        ours_err, peer_err = ((g[name].float() - w).abs().max() / size for g in (ours, peer))
        assert ours_err <= 2 * peer_err + 1e-3, (name, float(ours_err), float(peer_err))


def test_what_the_backward_does_not_build_raises_by_name_at_backward():
    ids = torch.randint(1, VOCAB, (2, 10), generator=torch.Generator().manual_seed(3))
    model = tiny("llama", "tvm_attention").to(torch.float16)
    out = model(input_ids=ids, use_cache=False).logits
    with pytest.raises(hf.UnsupportedAttention, match="backward passes with float16"):
        out.float().sum().backward()
