"""The Hugging Face transformers backend (``tvm_attention.integrations.transformers``).

A small random-weight Llama with GQA generates greedily through ``attn_implementation=
"tvm_attention"`` exactly as with ``"sdpa"`` (batch 1 and 2), with one dynamic artifact built for
the whole run, loaded from disk by a second model load and by a fresh process; a corrupt cached
artifact is rebuilt with a warning; what the kernel cannot compute raises by name.
"""
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")

from conftest import LazyModule  # noqa: E402

#: imported by the first test that runs here, not at collection (conftest.LazyModule)
transformers = LazyModule("transformers")
if not transformers.available:
    pytest.skip("transformers is not installed (the [hf] extra)", allow_module_level=True)

from tvm_attention.integrations import transformers as hf  # noqa: E402
from tvm_attention.spec import AttentionSpec  # noqa: E402

VOCAB = 128
#: new tokens per generate: two windows of 8 past the long prompt, enough for every phase the
#: sliding-window checks name (a hole, then kv_start, then neither: within the first 7 steps)
NEW = 16
GEN = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0)  # no early eos


def tiny_config(**overrides):
    kw = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              num_hidden_layers=2, vocab_size=VOCAB, max_position_embeddings=256)
    kw.update(overrides)
    return transformers.LlamaConfig(**kw)


def tiny_llama(attn, cls=None, **overrides):
    torch.manual_seed(0)
    model = (cls or transformers.LlamaForCausalLM)(tiny_config(**overrides)).to(torch.float32).eval()
    model.set_attn_implementation(attn)
    return model


def prompt(batch, length=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (batch, length), generator=g)


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """The models are tiny: PyTorch's parallel regions (its projections and MLPs) cost more
    than their work, most of all on a busy machine. Only PyTorch's ops: the kernels keep their
    threads (and their one-thread switch for small calls)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _spin_env(monkeypatch):
    """register() sets TVM_THREAD_POOL_SPIN_COUNT when unset: undo it after each test."""
    monkeypatch.setenv(hf.SPIN_ENV, os.environ.get(hf.SPIN_ENV, "300000"))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh artifact cache (TVM_ATTENTION_CACHE_DIR) and fresh counters; registered."""
    monkeypatch.setenv("TVM_ATTENTION_CACHE_DIR", str(tmp_path))
    hf.register()
    hf.clear_kernels()
    hf.reset_stats()
    yield tmp_path
    hf.clear_kernels()


def only_artifact(root):
    dirs = [p for p in (root / hf.ARTIFACTS).iterdir() if p.is_dir() and not p.name.startswith(".")]
    assert len(dirs) == 1, dirs
    return dirs[0]


def test_generate_matches_sdpa_one_build_then_disk_cache(cache, tmp_path_factory):
    sdpa = tiny_llama("sdpa")
    tvm = tiny_llama("tvm_attention")
    for batch in (1, 2):
        ids = prompt(batch)
        want = sdpa.generate(ids, **GEN)
        got = tvm.generate(ids, **GEN)
        assert got.shape == (batch, ids.shape[1] + NEW)
        assert torch.equal(got, want), f"batch {batch}: tokens differ from sdpa"
    s = hf.stats()
    # one configuration (4 heads, 2 kv heads, d16, causal, 1/4) for both layers, prefill and
    # decode, batch 1 and 2: one dynamic artifact
    assert s["builds"] == 1 and s["loads"] == 0, s
    assert s["calls"] == 2 * 2 * NEW, s  # 2 layers x (prefill + NEW - 1 decode steps) x 2 generations
    art = only_artifact(cache)
    assert art.name.startswith("h4_kv2_d16_float32_causal_llvm-")
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["spec"]["scale"] == 0.25

    # A second load (attn_implementation at from_pretrained), no kernels in memory: disk, no build.
    saved = tmp_path_factory.mktemp("tiny_llama")
    sdpa.save_pretrained(saved)
    hf.clear_kernels()
    hf.reset_stats()
    again = transformers.LlamaForCausalLM.from_pretrained(saved, attn_implementation="tvm_attention", dtype=torch.float32).eval()
    assert again.config._attn_implementation == "tvm_attention"
    ids = prompt(2, seed=3)
    assert torch.equal(again.generate(ids, **GEN), sdpa.generate(ids, **GEN))
    assert hf.stats()["builds"] == 0 and hf.stats()["loads"] == 1, hf.stats()
    # (a fresh process finds an artifact on disk too: the loser of
    # test_concurrent_processes_build_once loads what the other process exported)

    # A corrupt cached library is rebuilt, with a warning, and generation still matches.
    # (a new file renamed over it: this process still maps the old library, which must not change)
    lib = art / "attention.so"
    bad = art.parent / "bad.so"
    bad.write_bytes(lib.read_bytes() + b"corrupt")
    os.replace(bad, lib)
    hf.clear_kernels()
    hf.reset_stats()
    with pytest.warns(RuntimeWarning, match="unusable.*rebuilding"):
        got = tvm.generate(prompt(1), **GEN)
    assert torch.equal(got, sdpa.generate(prompt(1), **GEN))
    assert hf.stats()["builds"] == 1 and hf.stats()["rebuilds"] == 1, hf.stats()
    assert only_artifact(cache) == art

    # Another configuration's artifact (intact: it loads, this process maps its library) in its
    # place: refused, rebuilt in the same folder, and the rebuilt library is the one this process
    # runs, in this call and every later one (a library loaded from the same path would be the
    # foreign one: the loader runs a private copy of what it checked).
    foreign = hf.LayerConfig(2, 1, 16, "float32", False, 0.3)
    hf.kernel_for(foreign)
    shutil.rmtree(art)
    shutil.copytree(hf.artifact_dir(foreign), art)
    hf.clear_kernels()
    hf.reset_stats()
    with pytest.warns(RuntimeWarning, match="unusable.*its manifest's spec .* is not .*rebuilding"):
        got = tvm.generate(prompt(1), **GEN)
    assert torch.equal(got, sdpa.generate(prompt(1), **GEN))
    hf.clear_kernels()
    assert torch.equal(tvm.generate(prompt(2), **GEN), sdpa.generate(prompt(2), **GEN))
    assert hf.stats()["rebuilds"] == 1 and hf.stats()["loads"] == 1, hf.stats()


def test_a_cache_folder_that_cannot_be_one_is_not_used(cache, recwarn):
    """register(cache_dir=) naming a file, or a folder other users may write: a warning naming
    it, and the model runs with artifacts in a temporary folder of this process (the build
    cache's builds: no compile)."""
    sdpa, tvm = tiny_llama("sdpa"), tiny_llama("tvm_attention")
    (cache / "file").write_text("")
    shared = cache / "shared"
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o777)
    try:
        for folder, why in ((cache / "file", "is not a folder"), (shared, "writable by other users")):
            hf.register(cache_dir=folder)
            with pytest.warns(RuntimeWarning, match=f"{folder}.*{why}.*temporary folder for this process"):
                got = tvm.generate(prompt(1), **GEN)
            assert torch.equal(got, sdpa.generate(prompt(1), **GEN))
        assert not list(shared.iterdir())
    finally:
        hf.register()


def test_concurrent_processes_build_once(tmp_path):
    """Two fresh processes asking for one configuration at once: one builds, the other waits
    for the lock and loads what it exported (a fresh process, no kernel in memory, finds the
    artifact on disk). The Llama tests' configuration: its compiled library is in the run's
    build cache already, so the builder validates and exports without compiling again. No
    register(): kernel_for needs none (the cache folder comes from $TVM_ATTENTION_CACHE_DIR), and
    register's import of transformers' modeling code cost each process ~5 s of CPU."""
    code = textwrap.dedent("""
        import json
        from tvm_attention.integrations import transformers as hf
        hf.kernel_for(hf.LayerConfig(4, 2, 16, "float32", True, 0.25))
        print(json.dumps(hf.stats()))
    """)
    env = {**os.environ, "TVM_ATTENTION_CACHE_DIR": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for _ in range(2)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert sorted((r["builds"], r["loads"]) for r in results) == [(0, 1), (1, 0)], results
    assert only_artifact(tmp_path).name.startswith("h4_kv2_d16_float32_causal_llvm-")


def test_chunked_prefill_against_a_cache_is_bottom_right_causal(cache):
    """Sq > 1 against a non-empty DynamicCache (the second chunk of a prompt): the mask function
    returns None and the kernel's bottom-right causal masking is exact."""
    sdpa, tvm = tiny_llama("sdpa"), tiny_llama("tvm_attention")
    ids = prompt(2, length=20)
    outs = []
    for model in (sdpa, tvm):
        with torch.no_grad():
            first = model(ids[:, :12], use_cache=True)
            second = model(ids[:, 12:], cache=first.past_key_values, use_cache=True)
        outs.append(second.logits)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)
    assert hf.stats()["builds"] == 1


def test_mask_function_returns_none_only_for_plain_causal():
    from transformers import masking_utils as mu

    hf.register()
    causal = dict(batch_size=2, mask_function=mu.causal_mask_function)
    assert hf.attention_mask(q_length=5, kv_length=5, **causal) is None  # prefill, no cache
    assert hf.attention_mask(q_length=1, kv_length=9, q_offset=8, **causal) is None  # decode
    assert hf.attention_mask(q_length=4, kv_length=9, q_offset=5, **causal) is None  # chunk against a cache
    ones = torch.ones(2, 9, dtype=torch.bool)
    assert hf.attention_mask(q_length=1, kv_length=9, q_offset=8, attention_mask=ones, **causal) is None
    padded = ones.clone()
    padded[0, :3] = False
    # left padding: a plan whose kv_start hides each row's leading zeros
    m = hf.attention_mask(q_length=1, kv_length=9, q_offset=8, attention_mask=padded, **causal)
    assert getattr(m, hf._PLAN) == {"in_use": False, "kv_start": True, "keep": False}
    assert m.shape == (2, 1, 1, 2) and m[:, 0, 0, 1].tolist() == [3, 0]
    # a zero after a row's first token (a hole, right padding): not left padding, so the plan
    # carries the mask's columns of the keys for the key-mask variant (after the first two)
    holed = padded.clone()
    holed[1, 4] = False
    holed[1, 8] = False
    m = hf.attention_mask(q_length=1, kv_length=9, q_offset=8, attention_mask=holed, **causal)
    assert getattr(m, hf._PLAN) == {"in_use": False, "kv_start": False, "keep": True}
    assert m.dtype == torch.int32 and m.shape == (2, 1, 1, 2 + 9) and torch.equal(m[:, 0, 0, 2:], holed.int())
    # a static cache: the keys in use are a prefix of its slots -> their count, for the kvcache kernel
    m = hf.attention_mask(q_length=1, kv_length=16, q_offset=8, **causal)
    assert getattr(m, hf._PLAN) == {"in_use": True, "kv_start": False, "keep": False} and m.dtype == torch.int32
    assert m[:, 0, 0, 0].tolist() == [9, 9]
    m = hf.attention_mask(q_length=1, kv_length=16, q_offset=8, attention_mask=padded, **causal)
    assert m[:, 0, 0, 0].tolist() == [9, 9] and m[:, 0, 0, 1].tolist() == [3, 0]
    # ... with a hole: the columns of the 9 keys in use, not of the 16 slots
    m = hf.attention_mask(q_length=1, kv_length=16, q_offset=8, attention_mask=holed, **causal)
    assert getattr(m, hf._PLAN) == {"in_use": True, "kv_start": False, "keep": True}
    assert m[:, 0, 0, 0].tolist() == [9, 9] and torch.equal(m[:, 0, 0, 2:], holed.int())
    m = hf.attention_mask(q_length=1, kv_length=8, q_offset=8, kv_offset=4, **causal)  # an offset cache
    assert m is not None and "offset" in getattr(m, hf._MASK_REASON)
    # a causal sliding window is the kernel's own (the attention takes W from sliding_window)
    sliding = dict(batch_size=2, local_size=3, mask_function=mu.sliding_window_causal_mask_function(3))
    assert hf.attention_mask(q_length=5, kv_length=5, **sliding) is None
    assert hf.attention_mask(q_length=1, kv_length=3, q_offset=9, kv_offset=7, **sliding) is None  # the layer's kept keys
    # a sliding cache past its window hands over its last W - 1 keys and the new ones, from
    # position kv_offset: kv_start counts the padding from there (row 0's 8 zeros: 1 of them in
    # keys 7..9), and padding before kv_offset is out of the window (no plan at all)
    long_pad = torch.ones(2, 10, dtype=torch.bool)
    long_pad[0, :8] = False
    m = hf.attention_mask(q_length=1, kv_length=3, q_offset=9, kv_offset=7, attention_mask=long_pad, **sliding)
    assert getattr(m, hf._PLAN) == {"in_use": False, "kv_start": True, "keep": False}
    assert m[:, 0, 0].tolist() == [[3, 1], [3, 0]]
    long_pad[0, 7] = True
    assert hf.attention_mask(q_length=1, kv_length=3, q_offset=9, kv_offset=7, attention_mask=long_pad, **sliding) is None
    # a chunk of 4 against it (a continued prompt): W - 1 kept keys and the 4 new ones
    m = hf.attention_mask(q_length=4, kv_length=6, q_offset=6, kv_offset=4, attention_mask=long_pad, **sliding)
    assert m[:, 0, 0].tolist() == [[6, 3], [6, 0]]
    # a hole among the kept keys: the key mask's columns start at kv_offset too (row 1's zero at
    # position 8 is key 1 of keys 7..9; row 0's zeros before 7 are out of the window)
    long_pad[1, 8] = False
    m = hf.attention_mask(q_length=1, kv_length=3, q_offset=9, kv_offset=7, attention_mask=long_pad, **sliding)
    assert getattr(m, hf._PLAN) == {"in_use": False, "kv_start": False, "keep": True}
    assert m[:, 0, 0, 2:].tolist() == [[1, 1, 1], [1, 0, 1]]
    m = hf.attention_mask(q_length=1, kv_length=16, q_offset=8, **sliding)
    assert "static cache that is not full yet" in getattr(m, hf._MASK_REASON)
    m = hf.attention_mask(q_length=5, kv_length=5, local_size=2, batch_size=2,
                          mask_function=mu.sliding_window_causal_mask_function(3))  # W disagrees
    assert "sliding-window or chunked" in getattr(m, hf._MASK_REASON)
    assert hf.attention_mask(q_length=3, kv_length=7, batch_size=2, mask_function=mu.bidirectional_mask_function) is None
    # padding in a non-causal model is still refused by name (no key-mask variant for it)
    m = hf.attention_mask(q_length=9, kv_length=9, batch_size=2, mask_function=mu.bidirectional_mask_function,
                          attention_mask=holed)
    assert "non-causal" in getattr(m, hf._MASK_REASON)


def test_static_cache_generate_runs_the_kvcache_kernel_in_place(cache):
    """cache_implementation="static": keys and values are the whole preallocated cache; the
    mask function hands over the keys in use and the kvcache artifact reads only those. One
    artifact serves prefill, decode and the last step (the cache full)."""
    sdpa, tvm = tiny_llama("sdpa"), tiny_llama("tvm_attention")
    for batch in (1, 2):
        ids = prompt(batch)
        want = sdpa.generate(ids, cache_implementation="static", **GEN)
        assert torch.equal(tvm.generate(ids, cache_implementation="static", **GEN), want), f"batch {batch}"
    s = hf.stats()
    assert s["builds"] == 1 and s["calls"] == 2 * 2 * NEW, s
    assert only_artifact(cache).name.startswith("kvcache_h4_kv2_d16_float32_causal_llvm-")


def assert_bf16_logits_close(model, peer, ids):
    """The prefill logits of ``ids[:, :-1]`` and those of a decode step with the last token
    through the cache agree between ``model`` and ``peer`` to bf16 rounding."""
    outs = []
    for m in (model, peer):
        with torch.no_grad():
            first = m(ids[:, :-1], use_cache=True)
            step = m(ids[:, -1:], cache=first.past_key_values, use_cache=True)
        outs.append((first.logits.float(), step.logits.float()))
    for got, want in zip(*outs):
        torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)


def test_bfloat16_model_matches_sdpa(cache):
    """A bfloat16 model runs the bf16 kernels (dot products on AVX512-BF16 where the CPU has them):
    prefill logits and a decode step through the cache agree with SDPA in bf16 to bf16 rounding
    (greedy tokens of a random model can flip on near-ties, so logits are compared)."""
    sdpa, tvm = (tiny_llama(impl).to(torch.bfloat16) for impl in ("sdpa", "tvm_attention"))
    assert_bf16_logits_close(tvm, sdpa, prompt(2, length=40))
    s = hf.stats()
    assert s["builds"] == 1 and s["calls"] == 2 * 2, s
    assert only_artifact(cache).name.startswith("h4_kv2_d16_bfloat16_causal_")
    mixed = torch.zeros(1, 4, 3, 16, dtype=torch.bfloat16), torch.zeros(1, 2, 3, 16)
    module = torch.nn.Module()
    with pytest.raises(hf.UnsupportedAttention, match="one dtype"):
        hf.attention_forward(module, mixed[0], mixed[1], mixed[1], None, scaling=0.25)


@pytest.mark.parametrize("cache_implementation", ["dynamic", "static"])
def test_left_padded_batch_matches_eager(cache, cache_implementation):
    """A batch of prompts of different lengths, left-padded (generate with a padded
    attention_mask): kv_start hides the pad keys, in the bhsd kernel (DynamicCache) and the
    kvcache one (StaticCache). Greedy tokens equal eager's."""
    eager, tvm = tiny_llama("eager"), tiny_llama("tvm_attention")
    ids = prompt(3)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    mask[2, :9] = 0
    ids = ids.masked_fill(mask == 0, 0)
    kw = dict(GEN, attention_mask=mask, cache_implementation=cache_implementation)
    assert torch.equal(tvm.generate(ids, **kw), eager.generate(ids, **kw))
    layout = "kvcache_" if cache_implementation == "static" else ""
    assert only_artifact(cache).name.startswith(f"{layout}h4_kv2_d16_float32_causal_kvstart_")
    # an all-ones mask is plain causal
    assert hf.attention_mask(batch_size=2, q_length=12, kv_length=12, attention_mask=mask[:2].bool().fill_(True)) is None


def tiny(cls_name, config_name, **kw):
    """A tiny random-weight model of a transformers family, float32, eval."""
    conf = getattr(transformers, config_name)(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                              num_key_value_heads=2, head_dim=16, vocab_size=VOCAB,
                                              max_position_embeddings=256, **kw)
    torch.manual_seed(0)
    return getattr(transformers, cls_name)(conf).to(torch.float32).eval()


#: family -> (model class, config class, config overrides, artifacts its layers need)
FAMILIES = {
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(num_hidden_layers=2, sliding_window=8), 1),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config",
              dict(num_hidden_layers=2, use_sliding_window=True, sliding_window=8, max_window_layers=1), 2),
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config",
               dict(num_hidden_layers=2, sliding_window=8, attn_logit_softcapping=5.0, query_pre_attn_scalar=16), 2),
    "gpt_oss": ("GptOssForCausalLM", "GptOssConfig",
                dict(num_hidden_layers=2, sliding_window=8, num_local_experts=4, num_experts_per_tok=2), 2),
}


def assert_generate_matches(model, peer, ids, gen, what):
    """Greedy tokens of ``model.generate`` identical to ``peer``'s, and the logits of every step
    equal to float32 rounding: a window one key too wide changes a random model's logits by
    ~1e-1 (more than its greedy tokens: the decode steps of a sliding layer only get the W keys
    its cache keeps), an exact one by ~1e-7."""
    kw = dict(gen, return_dict_in_generate=True, output_logits=True)
    got, want = model.generate(ids, **kw), peer.generate(ids, **kw)
    assert torch.equal(got.sequences, want.sequences), f"{what}: tokens differ"
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), rtol=1e-4, atol=1e-4,
                               msg=lambda m: f"{what}: {m}")


#: a prompt more than three windows of 8 long (the sliding layers' caches drop keys from the prefill on)
LONG_PROMPT = 3 * 8 + 2
#: the family whose long prompt also runs as a left-padded batch (every layer sliding: one
#: kv_start artifact more, where the other families would build two each)
PADDED_FAMILY = "mistral"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_model_families_match_eager(cache, family):
    """Sliding windows (Mistral, Qwen2, Gemma-2, gpt-oss: a prompt of 12 and one of 26, more
    than three windows of 8, each + 16 new tokens, two windows more), Gemma-2's softcap on
    alternating sliding and global layers, gpt-oss's sinks: greedy tokens identical to eager in
    float32, and logits equal to rounding. With the long prompt the sliding layers' caches
    (``DynamicSlidingWindowLayer``) keep only the last W − 1 keys: a decode step gets W keys
    that start at position ``kv_offset = p − W + 1``, a prefill all of them; both are the
    window's bottom-right alignment, with the same artifacts. Mistral's long prompt also runs
    left-padded (:func:`check_long_left_padded_batch`), Gemma-2's with pad tokens inside and
    no attention_mask (:func:`check_pad_tokens_inside_a_long_prompt`)."""
    cls, conf, kw, artifacts = FAMILIES[family]
    if not hasattr(transformers, cls):
        pytest.skip(f"this transformers has no {cls}")
    eager, tvm = tiny(cls, conf, **kw), tiny(cls, conf, **kw)
    eager.set_attn_implementation("eager")
    tvm.set_attn_implementation("tvm_attention")
    for length in (12, LONG_PROMPT):
        ids = prompt(2, length=length)  # batch 2: the kernels' batch loop (batch 1 is the Llama test's)
        assert_generate_matches(tvm, eager, ids, GEN, f"{family}, prompt {length}")
    names = sorted(p.name for p in (cache / hf.ARTIFACTS).iterdir() if p.is_dir())
    assert len(names) == artifacts, names
    assert any("_w7_0" in n for n in names), names  # sliding_window 8 is the window (7, 0)
    if family == PADDED_FAMILY:  # here, where the unpadded kernel it also runs is built already
        check_long_left_padded_batch(tvm, eager, cache)
    if family == "gemma2":  # likewise: its sliding decode steps past the holes run the plain kernel
        check_pad_tokens_inside_a_long_prompt(tvm, eager, cache)


def check_long_left_padded_batch(tvm, eager, cache):
    """A left-padded batch with a prompt more than three windows long through the caches that
    drop keys (Mistral: every layer sliding, window 8): rows padded by 0, 11 (more than a
    window) and 22 (a prompt shorter than a window) tokens, 16 new ones, with a
    ``DynamicCache`` and a static one (``StaticSlidingWindowLayer``, what ``cache_implementation=
    "static"`` or ``"hybrid"`` gives sliding layers, Gemma-2's too). A decode step's keys start at
    ``kv_offset`` = its position − W + 1 (19 for the first), and the mask function reads the 2D
    mask from there: row 2's padding is in the window for the first steps (``kv_start`` 3, 2, 1,
    in the window's own index), then no row's is (the plain windowed kernel). Tokens and logits
    equal eager's; both caches run the same two bhsd artifacts (a static sliding layer that the
    prompt has filled hands over only keys in use: no kvcache artifact)."""
    ids = prompt(3, length=LONG_PROMPT)
    mask = torch.ones_like(ids)
    mask[1, :11] = 0
    mask[2, :22] = 0
    ids = ids.masked_fill(mask == 0, 0)
    for cache_implementation in ("dynamic", "static"):
        gen = dict(GEN, attention_mask=mask, cache_implementation=cache_implementation)
        assert_generate_matches(tvm, eager, ids, gen, f"left-padded, {cache_implementation} cache")
    names = sorted(p.name.split("_llvm")[0] for p in (cache / hf.ARTIFACTS).iterdir() if p.is_dir())
    assert names == ["h4_kv2_d16_float32_causal_w7_0", "h4_kv2_d16_float32_causal_w7_0_kvstart"], names


def assert_logits_match_where_kept(model, peer, ids, mask, what, cache=None):
    """A forward of ``ids`` with the 2D ``mask``: the logits of every position the mask keeps
    equal ``peer``'s to float32 rounding. Pad positions are left out: a pad query that sees no
    key (a leading one, or a run of pads a window long) outputs zeros in the kernels, where
    eager's softmax over keys all masked averages them; no kept position reads that output (its
    key is masked for every row). ``cache(model)``: the cache to run it with (default: none given,
    a DynamicCache)."""
    outs = []
    for m in (model, peer):
        with torch.no_grad():
            outs.append(m(ids, attention_mask=mask, **({} if cache is None else dict(cache=cache(m)))).logits)
    kept = mask.bool()
    torch.testing.assert_close(outs[0][kept], outs[1][kept], rtol=1e-4, atol=1e-4, msg=lambda m: f"{what}: {m}")


def check_pad_tokens_inside_a_long_prompt(tvm, eager, cache):
    """The issue: Gemma-2 ``generate()`` WITHOUT an attention_mask on a prompt more than three
    windows long that holds the pad token (its config's pad_token_id, 0) inside: generate makes
    the mask ``input_ids != 0``, zeros inside rows, which eager attends around. Served by the
    key-mask variant, on both layers (sliding and global, softcap on both): row 0 holds pads at
    9, 10 and 22, row 1 at 4, 17 and 24, so the sliding layers' first decode steps (kept keys
    from ``kv_offset`` = p − 7) still meet a hole, then one whose kept keys start with the pad
    (left padding in the window's own index: ``kv_start``, the fast path), then none (the plain
    windowed kernel); 16 new tokens. Greedy tokens identical to eager in float32, the logits of
    every step (the last prompt position is a real token) and of every real prompt position. (A
    static cache adds one kvcache build for the global layers; the key mask's kvcache layout is
    :func:`test_padding_with_holes_matches_eager`'s, a full static sliding layer's ``kv_offset``
    :func:`check_long_left_padded_batch`'s.)"""
    assert tvm.generation_config.pad_token_id == 0 and eager.generation_config.pad_token_id == 0
    ids = prompt(2, length=LONG_PROMPT)
    ids[0, [9, 10, 22]] = 0
    ids[1, [4, 17, 24]] = 0
    gen = {k: v for k, v in GEN.items() if k != "pad_token_id"}  # the model's own, as in the issue
    assert_generate_matches(tvm, eager, ids, gen, "pad tokens inside a long prompt, no attention_mask")
    assert_logits_match_where_kept(tvm, eager, ids, ids.ne(0).long(), "pad tokens inside a long prompt")
    names = sorted(p.name.split("_llvm")[0] for p in (cache / hf.ARTIFACTS).iterdir() if p.is_dir())
    mod = hf.LayerConfig(4, 2, 16, "float32", True, 0.25, key_mask=True).spec().variant_suffix()
    assert names == ["h4_kv2_d16_float32_causal_cap5", f"h4_kv2_d16_float32_causal_cap5{mod}",
                     "h4_kv2_d16_float32_causal_w7_0_cap5", "h4_kv2_d16_float32_causal_w7_0_cap5_kvstart",
                     f"h4_kv2_d16_float32_causal_w7_0_cap5{mod}"], names


@pytest.mark.parametrize("cache_implementation", ["dynamic", "static"])
def test_padding_with_holes_matches_eager(cache, cache_implementation):
    """A batch whose 2D attention_mask has zeros after a row's first token, passed explicitly
    through a plain causal Llama: right padding (row 0), a run of two inside (row 1), left
    padding and a hole (row 2). kv_start cannot express them: the key-mask variant reads the
    mask's columns per score, in the bhsd kernel (DynamicCache) and the kvcache one (StaticCache:
    the columns of the keys in use). The logits of every real prompt position equal eager's, and
    generate gives eager's tokens and step logits (row 0's first step reads a pad position that
    sees keys: exact too)."""
    eager, tvm = tiny_llama("eager"), tiny_llama("tvm_attention")
    ids = prompt(3)
    mask = torch.ones_like(ids)
    mask[0, 9:] = 0
    mask[1, 4:6] = 0
    mask[2, :3] = 0
    mask[2, 7] = 0
    ids = ids.masked_fill(mask == 0, 0)

    def static(m):  # more slots than keys: the kvcache kernel reads the 12 in use
        return transformers.StaticCache(config=m.config, max_cache_len=ids.shape[1] + 4)

    assert_logits_match_where_kept(tvm, eager, ids, mask, f"holes, {cache_implementation} cache",
                                   cache=static if cache_implementation == "static" else None)
    gen = dict(GEN, attention_mask=mask, cache_implementation=cache_implementation)
    assert_generate_matches(tvm, eager, ids, gen, f"holes, {cache_implementation} cache")
    layout = "kvcache_" if cache_implementation == "static" else ""
    mod = hf.LayerConfig(4, 2, 16, "float32", True, 0.25, key_mask=True).spec().variant_suffix()
    assert only_artifact(cache).name.startswith(f"{layout}h4_kv2_d16_float32_causal{mod}_"), only_artifact(cache)


def test_gemma2_in_bfloat16_matches_eager_to_rounding(cache):
    """A bfloat16 Gemma-2 (softcap on every layer, windows on alternate ones; gpt-oss's sinks are
    the fp32 test's): prefill logits past the window and a decode step agree with eager in bf16
    to bf16 rounding (greedy tokens of a random model can flip on near-ties, so logits are
    compared)."""
    family = "gemma2"
    cls, conf, kw, _ = FAMILIES[family]
    if not hasattr(transformers, cls):
        pytest.skip(f"this transformers has no {cls}")
    models = []
    for impl in ("tvm_attention", "eager"):
        models.append(tiny(cls, conf, **kw).to(torch.bfloat16))
        models[-1].set_attn_implementation(impl)
    assert_bf16_logits_close(*models, prompt(2, length=20))


#: a tiny DeepSeek-V3: MLA with q/kv low-rank projections, query and key of 16 + 8 = 24 columns
#: (no-rope + rope), value and output of 16 — the attention sees Dqk ≠ Dv; one dense layer, one
#: MoE layer; init 0.1 so that the scores are far from uniform (0.02 makes every row's softmax flat)
DEEPSEEK = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4,
                num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=256, num_hidden_layers=2,
                first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
                n_shared_experts=1, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                v_head_dim=16, initializer_range=0.1)


def tiny_deepseek(attn, dtype=torch.float32):
    if not hasattr(transformers, "DeepseekV3ForCausalLM"):
        pytest.skip("this transformers has no DeepseekV3ForCausalLM")
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**DEEPSEEK)).to(dtype).eval()
    model.set_attn_implementation(attn)  # its own config: models sharing one would share this too
    return model


@pytest.mark.parametrize("cache_implementation", ["dynamic", "static"])
def test_deepseek_v3_mla_matches_eager(cache, cache_implementation):
    """DeepSeek-V3's multi-head latent attention, as transformers runs it (the latent cached, K
    and V expanded per call: query/key 24 columns, value 16): greedy tokens identical to eager in
    float32 with logits equal to rounding, through the bhsd kernel (DynamicCache) and the kvcache
    one (StaticCache), each artifact built with ``head_dim_v``."""
    eager, tvm = tiny_deepseek("eager"), tiny_deepseek("tvm_attention")
    assert_generate_matches(tvm, eager, prompt(2), dict(GEN, cache_implementation=cache_implementation),
                            f"DeepSeek-V3, {cache_implementation} cache")
    layout = "kvcache_" if cache_implementation == "static" else ""
    assert only_artifact(cache).name.startswith(f"{layout}h4_kv4_d24v16_float32_causal_"), only_artifact(cache)
    assert AttentionSpec.from_dict(json.loads((only_artifact(cache) / "manifest.json").read_text())["spec"]
                                   ).v_dim == 16


def bf16_logits(model, ids):
    """Prefill logits of ``ids[:, :-1]`` then a decode step's with the last token, as float32."""
    with torch.no_grad():
        first = model(ids[:, :-1], use_cache=True)
        step = model(ids[:, -1:], cache=first.past_key_values, use_cache=True)
    return torch.cat([first.logits.float(), step.logits.float()], dim=1)


def test_deepseek_v3_in_bfloat16_matches_eager_to_rounding(cache):
    """The bfloat16 DeepSeek-V3 (the bf16 kernels with Dqk ≠ Dv), prefill and a decode step: its
    logits lie as close to the float32 model's as eager's in bf16 do (a MoE's router turns one
    rounding into a different expert, so the two bf16 runs differ from each other by more than
    either differs from float32 on average), and within 6e-2 of eager's bf16 logits."""
    ids = prompt(2, length=20)
    exact = bf16_logits(tiny_deepseek("eager"), ids)
    got = bf16_logits(tiny_deepseek("tvm_attention", torch.bfloat16), ids)
    eager = bf16_logits(tiny_deepseek("eager", torch.bfloat16), ids)
    ours, theirs = (got - exact).abs(), (eager - exact).abs()
    assert ours.max() <= 1.25 * theirs.max() and ours.mean() <= 1.25 * theirs.mean(), (ours.max(), theirs.max())
    torch.testing.assert_close(got, eager, atol=6e-2, rtol=3e-2)
    assert only_artifact(cache).name.startswith("h4_kv4_d24v16_bfloat16_causal_")


def test_packed_sequences_are_served_through_the_custom_mask(cache):
    """Two sequences packed in one row (position_ids restart, no attention_mask, no cache:
    transformers builds a packed-sequence mask): the logits equal eager's, through one non-causal
    artifact with a custom mask (``_cm``) whose bits hold the two causal blocks."""
    eager, tvm = tiny_llama("eager"), tiny_llama("tvm_attention")
    ids = prompt(1, length=14)
    pos = torch.tensor([list(range(6)) + list(range(8))])
    with torch.no_grad():
        want, got = (m(ids, position_ids=pos, use_cache=False).logits for m in (eager, tvm))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert only_artifact(cache).name.startswith("h4_kv2_d16_float32_full_cm_"), only_artifact(cache)


def test_4d_masks_with_a_bidirectional_prefix(cache):
    """A prefix-LM mask given to the model as 4-D (Gemma-3's image tokens: the first 5 tokens see
    each other both ways, the rest is causal): the boolean form equals SDPA's logits (True:
    visible; eager would add the booleans to the scores) and the additive 0/−inf form equals
    eager's, both through the custom mask, one artifact."""
    n = 12
    seen = torch.tril(torch.ones(n, n, dtype=torch.bool))
    seen[:5, :5] = True
    boolean = seen[None, None].expand(2, 1, n, n)
    additive = torch.zeros(2, 1, n, n).masked_fill(~boolean, float("-inf"))
    ids = prompt(2, length=n)
    tvm = tiny_llama("tvm_attention")
    with torch.no_grad():
        for mask, peer in ((boolean, "sdpa"), (additive, "eager")):
            want = tiny_llama(peer)(ids, attention_mask=mask).logits
            torch.testing.assert_close(tvm(ids, attention_mask=mask).logits, want, rtol=1e-4, atol=1e-4,
                                       msg=lambda m, peer=peer: f"{peer}: {m}")
    assert hf.stats()["builds"] == 1 and only_artifact(cache).name.startswith("h4_kv2_d16_float32_full_cm_")


def test_dropout_in_training_raises(cache):
    tvm = tiny_llama("tvm_attention", attention_dropout=0.1)
    tvm.train()
    with pytest.raises(hf.UnsupportedAttention, match="attention dropout"):
        tvm(prompt(1))


@pytest.mark.parametrize("kwargs, match", [
    (dict(s_aux=torch.zeros(3)), "attention sinks"),
    (dict(sliding_window=0), "sliding window"),
    (dict(position_bias=torch.zeros(1, 4, 3, 3)), "position bias"),
    (dict(dtype=torch.float64), "dtype float64"),
    (dict(value=torch.zeros(1, 2, 4, 8)), "these shapes"),  # value's keys must be key's
    # a 4-D mask is served through the custom mask when it is the same for every head and, additive,
    # only 0 and -inf; a bias, the dtype's minimum or a mask per head stays refused
    (dict(attention_mask=torch.full((1, 1, 3, 3), -1.0)), "additive attention mask: it holds values other than"),
    (dict(attention_mask=torch.full((1, 1, 3, 3), torch.finfo(torch.float32).min)), "additive attention mask"),
    (dict(attention_mask=torch.eye(3, dtype=torch.bool).repeat(1, 4, 1, 1).index_fill_(1, torch.tensor([2]), True)),
     "per-head attention mask"),
    (dict(attention_mask=torch.ones(1, 1, 2, 3, dtype=torch.bool)), "this attention mask: shape"),
])
def test_unsupported_features_raise_by_name(kwargs, match):
    dtype = kwargs.pop("dtype", torch.float32)
    mask = kwargs.pop("attention_mask", None)
    q = torch.zeros(1, 4, 3, 16, dtype=dtype)
    kv = torch.zeros(1, 2, 3, 16, dtype=dtype)
    v = kwargs.pop("value", kv)
    module = torch.nn.Module()
    module.is_causal = True
    with pytest.raises(hf.UnsupportedAttention, match=match):
        hf.attention_forward(module, q, kv, v, mask, scaling=0.25, **kwargs)


def test_register_names_and_cache_dir(tmp_path, monkeypatch):
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    monkeypatch.setenv("TVM_ATTENTION_CACHE_DIR", str(tmp_path / "env"))
    try:
        assert hf.register(cache_dir=tmp_path / "mine") == "tvm_attention"
        assert ALL_ATTENTION_FUNCTIONS["tvm_attention"] is hf.attention_forward
        assert ALL_MASK_ATTENTION_FUNCTIONS["tvm_attention"] is hf.attention_mask
        assert hf.artifact_root() == tmp_path / "mine"
        hf.register()
        assert hf.artifact_root() == tmp_path / "env" / "artifacts"
    finally:
        hf.register()
    a = hf.LayerConfig(8, 2, 64, "float32", True, 0.125)
    b = hf.LayerConfig(8, 2, 64, "float32", True, 0.1250001)
    t = hf.resolved_target()
    assert a.key(t) != b.key(t) and a.key(t).startswith("h8_kv2_d64_float32_causal_")
    # a non-causal configuration's name (no model here is one; no build needed for its key)
    assert hf.LayerConfig(2, 1, 16, "float32", False, 0.3).key(t).startswith("h2_kv1_d16_float32_full_")


def test_register_sets_spin_count_only_when_unset(monkeypatch):
    monkeypatch.delenv(hf.SPIN_ENV)
    hf.register()
    assert os.environ[hf.SPIN_ENV] == "0"
    monkeypatch.setenv(hf.SPIN_ENV, "5")
    hf.register()
    assert os.environ[hf.SPIN_ENV] == "5"

