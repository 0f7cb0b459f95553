"""verify where the model lives: an original that cannot be built or run here names the
transformers its config.json was saved with (inside the range kvskill supports, else says
plainly that it cannot), and an original only the shrink breaks is kvskill's error."""

from __future__ import annotations

import json

import pytest
import transformers
from kvskill.cli import main
from remote_model import MODELING, write_remote_model

#: what a vendor file written for transformers 4.x imports (gone from transformers 5)
OLD_IMPORT = "from transformers.modeling_attn_mask_utils import _prepare_4d_causal_attention_mask\n"
#: a check of the model's own that only the shrunk config fails (like a vocabulary the
#: tokenizer's special ids must fit in)
OWN_CHECK = (
    "        if config.vocab_size < 300:\n"
    '            raise ValueError(f"vocab_size {config.vocab_size} leaves no room for the special ids")\n'
)


def run_cli(capsys, *args: str) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(args))
    return exc.value.code, capsys.readouterr().err


def _converted(tmp_path, capsys, modeling: str, **config) -> str:
    source = write_remote_model(tmp_path / "source", modeling=modeling)
    saved = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**saved, **config}))
    out = tmp_path / "out"
    code, err = run_cli(capsys, "apply", str(source), "--out", str(out))
    assert code == 0, err
    return str(out)


def _in_attention_init(check: str) -> str:
    anchor = "        self.layer_idx = layer_idx\n"
    assert anchor in MODELING
    return MODELING.replace(anchor, anchor + check, 1)


def test_a_file_for_an_older_transformers_names_its_version_and_how_to_verify_there(
    tmp_path, capsys
):
    modeling = MODELING.replace("import torch\n", "import torch\n" + OLD_IMPORT, 1)
    out = _converted(tmp_path, capsys, modeling, transformers_version="4.46.3")
    code, err = run_cli(capsys, "verify", out, "--trust-remote-code")
    assert code == 2  # bad input, as before
    line = err.strip()
    assert "\n" not in line and "Traceback" not in line
    assert "cannot be built from the shrunk config: ModuleNotFoundError" in line
    assert f"saved with transformers 4.46.3 (installed: {transformers.__version__})" in line
    assert "pip install transformers==4.46.3 kvskill" in line and "make test-compat" in line
    # the full-size original fails the same way: --no-shrink cannot help
    assert "--no-shrink" not in line


def test_an_original_only_the_shrink_breaks_is_kvskill_s_error(tmp_path, capsys):
    out = _converted(
        tmp_path,
        capsys,
        _in_attention_init(OWN_CHECK),
        vocab_size=512,
        transformers_version="4.46.3",
    )
    code, err = run_cli(capsys, "verify", out, "--trust-remote-code")
    assert code == 70  # kvskill's own error, not bad input
    assert "vocab_size 256 leaves no room" in err
    assert "the unshrunk config builds here" in err and "kvskill's shrink broke" in err
    assert "--no-shrink" in err
    # the model runs under the installed transformers: no advice about its version
    assert "saved with transformers" not in err
    code, err = run_cli(capsys, "verify", out, "--trust-remote-code", "--no-shrink")
    assert code == 0, err


def test_a_config_the_full_model_refuses_too_gets_no_no_shrink_hint(tmp_path, capsys):
    out = _converted(tmp_path, capsys, _in_attention_init(OWN_CHECK), vocab_size=256)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["vocab_size"] == 256  # the original check fails at any size
    code, err = run_cli(capsys, "verify", out, "--trust-remote-code")
    assert code == 2 and "leaves no room" in err
    assert "--no-shrink" not in err


def test_a_generation_only_the_shrunk_config_breaks_suggests_no_shrink(tmp_path, capsys):
    # The check runs in forward: the shrunk original builds, then fails to generate; the
    # unshrunk one builds and runs a forward pass (a small model: for real).
    anchor = "        bsz, q_len, _ = hidden_states.size()\n"
    check = (
        '        if self.vocab < 300:\n            raise IndexError("token ids past the table")\n'
    )
    modeling = _in_attention_init("        self.vocab = config.vocab_size\n")
    modeling = modeling.replace(anchor, anchor + check, 1)
    out = _converted(tmp_path, capsys, modeling, vocab_size=512)
    code, err = run_cli(capsys, "verify", out, "--trust-remote-code")
    assert code == 70
    assert "fails to generate with the shrunk config: IndexError" in err
    assert "kvskill's shrink broke" in err and "--no-shrink" in err


@pytest.mark.parametrize("saved", ["4.31.0", "4.40.0", "6.1.0"])
def test_a_transformers_kvskill_does_not_support_is_never_advised(tmp_path, capsys, saved):
    modeling = MODELING.replace("import torch\n", "import torch\n" + OLD_IMPORT, 1)
    out = _converted(tmp_path, capsys, modeling, transformers_version=saved)
    code, err = run_cli(capsys, "verify", out, "--trust-remote-code")
    assert code == 2
    line = err.strip()
    assert "\n" not in line and "Traceback" not in line
    assert f"saved with transformers {saved}, which kvskill does not support" in line
    assert "it needs transformers" in line and "4.46" in line
    assert "pip install" not in line  # an install pip would refuse beside kvskill
    assert "port the modeling file" in line


def test_the_supported_range_is_the_installed_requirement():
    from kvskill.verify.reference.original_failure import supported_transformers
    from packaging.specifiers import SpecifierSet

    supported = SpecifierSet(supported_transformers())
    assert "4.46.3" in supported and "5.24.0" in supported
    assert "4.45.2" not in supported and "6.0.0" not in supported
