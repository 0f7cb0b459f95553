"""The fused q/k/v layout is read from the cut the forward makes, one case per vendor shape.

Each snippet is written here in the shape of a public modeling file's split (named in the
case id); none is copied from one."""

import textwrap

import pytest
from kvskill.analyzer.qkv_split import QkvLayout, classify_qkv_split, fused_qkv_note

CASES = {
    # InternLM2: einops grouping with gs = G + 2 per KV group
    "internlm2_rearrange": (
        "wqkv",
        """
        def forward(self, hidden_states):
            qkv = self.wqkv(hidden_states)
            qkv = rearrange(qkv, "b q (h gs d) -> b q h gs d", gs=2 + self.num_key_value_groups, d=self.head_dim)
            query = qkv[..., : self.num_key_value_groups, :]
        """,
        QkvLayout.PER_KV_GROUP,
        4,
    ),
    # Falcon-40B (new decoder architecture): the view sits in a helper the forward calls
    "falcon_helper_method": (
        "query_key_value",
        """
        def _split_heads(self, fused_qkv):
            batch, seq_len, _ = fused_qkv.shape
            qkv = fused_qkv.view(batch, seq_len, -1, self.num_heads // self.num_kv_heads + 2, self.head_dim)
            return qkv[:, :, :, :-2], qkv[:, :, :, [-2]], qkv[:, :, :, [-1]]

        def forward(self, hidden_states):
            fused_qkv = self.query_key_value(hidden_states)
            query, key, value = self._split_heads(fused_qkv)
        """,
        QkvLayout.PER_KV_GROUP,
        4,
    ),
    # per group with the G + 2 axis left to -1 and cut by torch.split sizes
    "kv_groups_then_minus_one": (
        "wqkv",
        """
        def forward(self, hidden_states):
            b, s, _ = hidden_states.shape
            qkv = self.wqkv(hidden_states).view(b, s, self.num_key_value_heads, -1, self.head_dim)
            query, key, value = torch.split(qkv, [self.num_key_value_groups, 1, 1], dim=3)
        """,
        QkvLayout.PER_KV_GROUP,
        4,
    ),
    # GPT-NeoX (4.3x): a local shape tuple, heads then 3 * head_size
    "neox_shape_tuple": (
        "query_key_value",
        """
        def forward(self, hidden_states):
            qkv = self.query_key_value(hidden_states)
            new_qkv_shape = qkv.size()[:-1] + (self.num_attention_heads, 3 * self.head_size)
            qkv = qkv.view(*new_qkv_shape)
            query = qkv[..., : self.head_size]
        """,
        QkvLayout.PER_HEAD,
        5,
    ),
    # GPT-NeoX (later): (*input_shape, -1, 3 * head_size), then chunk(3)
    "neox_unsized_heads": (
        "query_key_value",
        """
        def forward(self, hidden_states):
            input_shape = hidden_states.shape[:-1]
            hidden_shape = (*input_shape, -1, 3 * self.head_size)
            qkv = self.query_key_value(hidden_states).view(hidden_shape).transpose(1, 2)
            query, key, value = qkv.chunk(3, dim=-1)
        """,
        QkvLayout.PER_HEAD,
        5,
    ),
    # Bloom: heads, then an axis of 3
    "bloom_heads_then_three": (
        "query_key_value",
        """
        def forward(self, hidden_states):
            fused_qkv = self.query_key_value(hidden_states)
            batch_size, seq_length, _ = fused_qkv.shape
            fused_qkv = fused_qkv.view(batch_size, seq_length, self.num_heads, 3, self.head_dim)
        """,
        QkvLayout.PER_HEAD,
        5,
    ),
    # GPT-2 / Qwen-7B c_attn: the flat rows split in thirds
    "gpt2_split_flat": (
        "c_attn",
        """
        def forward(self, hidden_states):
            query, key, value = self.c_attn(hidden_states).split(self.split_size, dim=2)
            query = query.view(query.size()[:-1] + (self.num_heads, self.head_dim))
        """,
        QkvLayout.CONTIGUOUS,
        3,
    ),
    # ChatGLM2/3: split into query, key, value widths (multi-query groups)
    "chatglm_split_sizes": (
        "query_key_value",
        """
        def forward(self, hidden_states):
            mixed = self.query_key_value(hidden_states)
            (q, k, v) = mixed.split(
                [self.num_heads * self.head_dim, self.num_groups * self.head_dim, self.num_groups * self.head_dim],
                dim=-1,
            )
        """,
        QkvLayout.CONTIGUOUS,
        4,
    ),
    # Baichuan W_pack: unflatten into (3, hidden)
    "baichuan_three_then_hidden": (
        "W_pack",
        """
        def forward(self, hidden_states):
            proj = self.W_pack(hidden_states)
            proj = proj.unflatten(-1, (3, self.hidden_size)).unsqueeze(0).transpose(0, -2)
        """,
        QkvLayout.CONTIGUOUS,
        4,
    ),
    # Phi-3: slices of the flat rows
    "phi3_row_slices": (
        "qkv_proj",
        """
        def forward(self, hidden_states):
            qkv = self.qkv_proj(hidden_states)
            query_pos = self.num_heads * self.head_dim
            query = qkv[..., :query_pos]
        """,
        QkvLayout.CONTIGUOUS,
        5,
    ),
    # OpenELM: a reshape that shows no order (-1 heads), then a split along the heads
    "openelm_heads_split": (
        "qkv_proj",
        """
        def forward(self, hidden_states):
            qkv = self.qkv_proj(hidden_states)
            qkv = qkv.reshape(b, s, self.num_q_heads + 2 * self.num_k_heads, self.head_dim)
            query, key, value = qkv.split([self.num_q_heads, self.num_k_heads, self.num_k_heads], dim=-2)
        """,
        QkvLayout.CONTIGUOUS,
        5,
    ),
}


def _source(body: str) -> str:
    """Line 1 is the class, line 2 the first line of BODY."""
    return "class Attention(nn.Module):\n" + textwrap.indent(
        textwrap.dedent(body).lstrip("\n"), "    "
    )


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_layout_and_line_are_those_of_the_cut(case):
    attr, body, layout, line = CASES[case]
    split = classify_qkv_split(_source(body), "Attention", attr)
    assert (split.layout, split.line) == (layout, line)


def test_branches_that_cut_differently_leave_the_layout_unknown():
    """Falcon picks its layout from the config at run time: no one cut is the fact."""
    body = """
    def _split_heads(self, fused_qkv):
        if self.new_decoder_architecture:
            qkv = fused_qkv.view(b, s, -1, self.num_heads // self.num_kv_heads + 2, self.head_dim)
        elif not self.multi_query:
            fused_qkv = fused_qkv.view(b, s, self.num_heads, 3, self.head_dim)
        return fused_qkv

    def forward(self, hidden_states):
        fused_qkv = self.query_key_value(hidden_states)
        return self._split_heads(fused_qkv)
    """
    split = classify_qkv_split(_source(body), "Attention", "query_key_value")
    assert split.layout is QkvLayout.UNKNOWN
    assert split.line == 3 and split.cut.startswith("if self.new_decoder_architecture:")


def test_a_branch_that_only_builds_the_output_does_not_decide():
    """InternLM2's pretraining_tp branch computes the same rows slice by slice; the cut
    after the if is the fact (the weight's own split is not a cut of the output)."""
    body = """
    def forward(self, hidden_states):
        if self.config.pretraining_tp > 1:
            slices = self.wqkv.weight.split(self.slice_rows, dim=0)
            qkv = torch.cat([F.linear(hidden_states, part) for part in slices], dim=-1)
        else:
            qkv = self.wqkv(hidden_states)
        qkv = rearrange(qkv, "b q (h gs d) -> b q h gs d", gs=2 + self.num_key_value_groups, d=self.head_dim)
    """
    split = classify_qkv_split(_source(body), "Attention", "wqkv")
    assert (split.layout, split.line) == (QkvLayout.PER_KV_GROUP, 8)


def test_the_forward_of_a_family_base_is_read():
    source = _source(CASES["falcon_helper_method"][1]) + "\n\nclass Flash(Attention):\n    pass\n"
    split = classify_qkv_split(source, "Flash", "query_key_value")
    assert split.layout is QkvLayout.PER_KV_GROUP


def test_a_projection_the_forward_never_cuts_is_unknown():
    body = """
    def forward(self, hidden_states):
        return self.wqkv(hidden_states)
    """
    assert classify_qkv_split(_source(body), "Attention", "wqkv").layout is QkvLayout.UNKNOWN


def test_the_evidence_names_the_cut_and_the_row_order():
    fused = {
        "class": "A",
        "attr": "wqkv",
        "layout": "per_kv_group",
        "split": "qkv.view(b, s, -1, G + 2, d)",
    }
    note = fused_qkv_note(fused)
    assert "cut by `qkv.view(b, s, -1, G + 2, d)`" in note
    assert "per KV group its query heads, then one key and one value head" in note
    assert "all query heads, then all key heads" not in note
    assert "refused" in fused_qkv_note({**fused, "layout": "unknown"})
