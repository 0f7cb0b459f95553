"""The DSA lint rules (KV015-KV019) on the call shapes the framework's DSA models use.

The framework builds the sparse operators' keywords in a dict and adds to it with
``.update({...})`` on some paths; each rule must read that as Python runs it: an update on
every path to the call is certain, one in a branch only possible. With
``KVSKILL_CANN_RECIPES=<checkout>`` the real DSA model files are linted too.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest
from kvskill.analyzer.lint import lint_paths, lint_source

DSA_RULES = {"KV015", "KV016", "KV017", "KV018", "KV019"}

HEADER = "import torch\nimport torch_npu\n\n"


def sparse_findings(body: str) -> list[tuple[str, int]]:
    code = HEADER + textwrap.dedent(body)
    return [(f.rule, f.line) for f in lint_source(code) if f.rule in DSA_RULES]


# the framework's shape (glm_5 / deepseek_v3_2_exp): literal, then a path-dependent update
FRAMEWORK_SHAPE = """\
def attend(self, q_nope, q_pe, k_nope, k_pe, topk, block_table, q_len, kv_len):
    kwargs = {
        "query": q_nope, "key": k_nope, "value": k_nope, "sparse_indices": topk,
        "scale_value": self.softmax_scale,
        "actual_seq_lengths_query": q_len.to(torch.int32),
        "actual_seq_lengths_kv": kv_len.to(torch.int32), "block_table": block_table,
        "sparse_block_size": 1, "layout_query": "TND", "layout_kv": "PA_BSND",
        "sparse_mode": 3,
    }
    if self.quant:
        kwargs.update({"key_quant_mode": 2, "attention_mode": 2})
        out = torch_npu.npu_kv_quant_sparse_flash_attention(**kwargs)
    else:
        kwargs.update({"query_rope": q_pe, "key_rope": k_pe, "attention_mode": 2})
        out, _, _ = torch_npu.npu_sparse_flash_attention(**kwargs)
    return out
"""


def test_an_update_on_every_path_to_the_call_counts_as_passed():
    assert sparse_findings(FRAMEWORK_SHAPE) == []


def test_an_update_in_a_branch_the_call_does_not_sit_in_is_only_possible():
    # attention_mode / rope are set only when `self.absorb`: the default 0 stays possible
    body = FRAMEWORK_SHAPE.replace(
        '    else:\n        kwargs.update({"query_rope": q_pe, "key_rope": k_pe, "attention_mode": 2})\n',
        '    else:\n        if self.absorb:\n            kwargs.update({"query_rope": q_pe, "key_rope": k_pe, "attention_mode": 2})\n',
    )
    assert body != FRAMEWORK_SHAPE
    assert [rule for rule, _ in sparse_findings(body)] == ["KV018"]


def test_a_bsnd_layout_in_the_literal_with_a_block_table_is_found_for_the_quant_twin_too():
    body = FRAMEWORK_SHAPE.replace('"layout_kv": "PA_BSND"', '"layout_kv": "BSND"')
    rules = [rule for rule, _ in sparse_findings(body)]
    assert rules == ["KV016", "KV016"]  # the quantized and the unquantized call


def test_an_unreadable_splat_reports_nothing():
    body = """\
    def attend(self, q):
        return torch_npu.npu_sparse_flash_attention(**self.options(q))
    """
    assert sparse_findings(body) == []


def test_a_dict_written_by_subscript_is_not_guessed():
    body = """\
    def attend(q_nope, q_pe, k, k_pe, topk, scale):
        kwargs = {"query": q_nope, "key": k, "value": k, "sparse_indices": topk,
                  "scale_value": scale, "query_rope": q_pe, "key_rope": k_pe}
        kwargs["attention_mode"] = 2
        return torch_npu.npu_sparse_flash_attention(**kwargs)[0]
    """
    assert sparse_findings(body) == []


def test_aliases_and_the_dispatcher_namespace_are_the_same_operator():
    body = """\
    import torch_npu as tnpu
    from torch_npu import npu_lightning_indexer as indexer

    def select(q, k, w, bt):
        a = indexer(q, k, w, block_table=bt, sparse_count=64)
        b = torch.ops.npu.npu_lightning_indexer.default(q, k, w, sparse_mode=2)
        c = tnpu.npu_lightning_indexer(q, k, w, atten_mask=None, sparse_mode=0)
        return a, b, c
    """
    # a: block table with the default 'BSND' key layout; b: mode 2; c: atten_mask=None passes
    # nothing and mode 0 is documented
    assert sparse_findings(body) == [("KV016", 8), ("KV017", 9)]


def test_lengths_as_tensors_pass_and_lists_are_found_through_a_variable():
    body = """\
    def select(q, k, w, lens):
        ok = torch_npu.npu_lightning_indexer(q, k, w, actual_seq_lengths_key=lens.int())
        as_list = [int(x) for x in lens]
        bad = torch_npu.npu_lightning_indexer(q, k, w, actual_seq_lengths_key=as_list)
        return ok, bad
    """
    assert sparse_findings(body) == [("KV019", 7)]


DSA_FILES = (
    "models/deepseek_v3_2_exp/models/modeling_deepseek.py",
    "models/deepseek_v3_2_exp/models/indexer.py",
    "models/glm_5/models/modeling_glm.py",
    "models/glm_5/models/indexer.py",
    "models/glm_5_2/models/modeling_glm.py",
    "models/glm_5_2/models/indexer.py",
)


@pytest.mark.skipif(
    not os.environ.get("KVSKILL_CANN_RECIPES"), reason="needs KVSKILL_CANN_RECIPES=<checkout>"
)
def test_the_frameworks_dsa_models_pass_the_dsa_rules():
    root = Path(os.environ["KVSKILL_CANN_RECIPES"])
    report = lint_paths([root / name for name in DSA_FILES])
    assert not report.errors
    assert [f for f in report.findings if f.rule in DSA_RULES] == []
