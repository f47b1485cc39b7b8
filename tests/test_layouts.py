"""The layout entries own their traits (issue 43, item 2): what another module reads off an entry
names something that exists, and the name tables it replaced are derived from the entries.
docs/design.md ("Adding a layout") runs a worked example of a new layout end to end."""
from tvm_attention.layouts import LAYOUTS, in_words, layouts_where


def test_every_entry_names_its_addressing_class_and_host_asserts():
    from tvm_attention.workloads import index_checks, kv

    for name, entry in LAYOUTS.items():
        assert (entry.addressing is None) == entry.packed, name  # a dense layout's K/V have a class
        assert entry.packed or entry.addressing in kv.ADDRESSING, name
        assert bool(entry.index_checks) == bool(entry.index_args), name  # index arrays obey rules
        assert not entry.index_checks or entry.index_checks in index_checks._CHECKS, name
        if entry.is_cache and not entry.paged:
            assert entry.args[1].dims[entry.capacity_axis] == entry.capacity_dim, name
        assert set(entry.cli_defaults) == {"batch", "seq_q", "seq_kv"} and entry.cli_help, name


def test_todays_trait_tables():
    from tvm_attention.schedules.family import SPLIT_LAYOUTS

    assert layouts_where("can_split") == SPLIT_LAYOUTS == ("kvcache", "paged")
    assert layouts_where("is_cache") == ("kvcache", "paged", "mla", "mla_paged")
    assert layouts_where("latent") == ("mla", "mla_paged")  # one cache for K and V (issue 44)
    assert layouts_where("packed") == ("varlen",)
    assert layouts_where("paged") == ("paged", "mla_paged")
    assert in_words(layouts_where("packed", False)) == "bhsd, kvcache, paged, mla and mla_paged"
    assert in_words(layouts_where("is_cache")) == "kvcache, paged, mla and mla_paged"


def test_a_layout_registered_after_the_schedules_import_is_built(monkeypatch):
    """docs/design.md adds a layout by registering it; the fused family's capabilities are the
    registry's live view, so registering after ``tvm_attention.schedules`` was imported (any build
    before it) still reaches the schedule."""
    from tvm_attention.layouts import LAYOUTS
    from tvm_attention.schedules import cpu_fused

    assert "later_layout" not in cpu_fused.CAPABILITIES.layouts
    monkeypatch.setitem(LAYOUTS, "later_layout", LAYOUTS["kvcache"])
    assert "later_layout" in cpu_fused.CAPABILITIES.layouts
