"""``kvskill_plan.json`` of a converted directory: the Plan plus the record of the conversion.

``apply`` writes the Plan's JSON with one more key, ``conversion``, holding what ``verify`` and
``run`` need to rebuild the original model and to pick who drives the converted one (the
bundled runtime, or the standalone runner named in the record). Reading goes through
:meth:`ConvertedDir.read`, which validates both halves once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from kvskill.analyzer.plan import DeployMode, FaVersion, Plan, read_json_object
from kvskill.core.errors import BadInputError

PLAN_FILE = "kvskill_plan.json"
#: bumped when the layout of kvskill_plan.json's "conversion" block changes
CONVERSION_FORMAT = 1


@dataclass(frozen=True, kw_only=True)
class StandaloneRecord:
    """What ``verify``/``run`` need to drive a standalone output's runner."""

    #: ``runner_<model>.py`` in the output directory
    runner: str
    #: "contiguous" | "paged" (``--kv-mode``) | "legacy" (mode 1 rows read by the model's own attention)
    kv_mode: str
    #: standalone mode 1 (contiguous), 2 (paged) or 3 (MLA absorb over paged)
    mode: int
    mla_absorb: bool
    input_layout: str
    block_size: int


@dataclass(frozen=True, kw_only=True)
class ReviewedPlan:
    """``apply --plan``: the reviewed plan file and the choices it set."""

    path: str
    #: choice field -> the value the plan gave (every choice, edited or not)
    choices: dict[str, Any]
    #: choice fields whose value differs from what the analysis decides on its own
    edited: list[str]


@dataclass(frozen=True, kw_only=True)
class ConversionRecord:
    """How ``apply`` converted the model (the ``conversion`` key of ``kvskill_plan.json``)."""

    format: int
    mode: DeployMode
    #: the ``--fa-version`` asked for: "auto" (the Plan's) | "v1" | "v2"
    fa_version: str
    modeling_file: str
    #: dotted package of a modeling file of the installed transformers, else None
    package: str | None
    original_sha256: str
    #: the modeling source before conversion, so verify can rebuild the reference exactly
    original_source: str
    standalone: StandaloneRecord | None = None
    reviewed_plan: ReviewedPlan | None = None
    #: the Python files kvskill wrote and their signature (``kvskill.core.trust``), so they
    #: run without ``--trust-remote-code``; None when unsigned
    written_code: dict[str, Any] | None = None
    #: ``apply --target``: "runtime" or "cann-recipes" (the executor's tree beside the code)
    target: str = "runtime"

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", DeployMode(self.mode))
        if self.mode is DeployMode.STANDALONE and self.standalone is None:
            raise BadInputError(
                "the conversion record is standalone but has no standalone record; re-run "
                "`kvskill apply --mode standalone`"
            )

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.name in ("standalone", "reviewed_plan", "written_code"):
                continue  # absent, not null: the JSON of a framework record is unchanged
            if f.name == "target" and value == "runtime":
                continue  # the default target, as before there was a choice
            if f.name in ("standalone", "reviewed_plan"):
                value = {g.name: getattr(value, g.name) for g in fields(value)}
            data[f.name] = value.value if isinstance(value, DeployMode) else value
        return data

    @classmethod
    def from_dict(cls, data: Any, where: Path) -> ConversionRecord:
        if not isinstance(data, dict) or "original_source" not in data:
            raise BadInputError(f"{where} has no conversion record; re-run `kvskill apply`")
        values = dict(data)
        try:
            if isinstance(values.get("standalone"), dict):
                values["standalone"] = StandaloneRecord(**values["standalone"])
            if isinstance(values.get("reviewed_plan"), dict):
                values["reviewed_plan"] = ReviewedPlan(**values["reviewed_plan"])
            return cls(**values)
        except (TypeError, ValueError) as exc:
            raise BadInputError(
                f"{where}: the conversion record is not one `kvskill apply` writes ({exc}); "
                "re-run `kvskill apply`"
            ) from exc


@dataclass(frozen=True, kw_only=True)
class ConvertedDir:
    """A directory ``apply`` wrote: its Plan, its conversion record and its config."""

    directory: Path
    plan: Plan
    record: ConversionRecord
    config: dict[str, Any]

    @property
    def is_standalone(self) -> bool:
        return self.record.mode is DeployMode.STANDALONE

    @property
    def fa_version(self) -> FaVersion:
        return self.plan.fa_version

    def check_layout(self, kv_layout: str) -> None:
        """A standalone runner allocates its own dense cache: only the default layout applies."""
        if self.is_standalone and kv_layout != "contiguous":
            raise BadInputError(
                f"--kv-layout {kv_layout} applies to framework outputs; the standalone runner "
                f"in {self.directory} allocates its own dense cache"
            )

    @classmethod
    def read(cls, directory: Path) -> ConvertedDir:
        """Read and validate ``kvskill_plan.json`` and ``config.json`` of ``directory``.

        Raises:
            BadInputError: a file is missing or malformed, or the record is incomplete.
        """
        plan_path = directory / PLAN_FILE
        if not plan_path.is_file():
            raise BadInputError(
                f"{directory} has no {PLAN_FILE}; convert the model with `kvskill apply` first"
            )
        config_path = directory / "config.json"
        if not config_path.is_file():
            raise BadInputError(f"{directory} has no config.json")
        data = read_json_object(plan_path)
        record = ConversionRecord.from_dict(data.get("conversion"), plan_path)
        if record.standalone and not (directory / record.standalone.runner).is_file():
            raise BadInputError(
                f"{directory} has no {record.standalone.runner} (named in {PLAN_FILE})"
            )
        return cls(
            directory=directory,
            plan=Plan.from_dict(data),
            record=record,
            config=read_json_object(config_path),
        )


def plan_file_text(plan: Plan, record: ConversionRecord) -> str:
    """The text of ``kvskill_plan.json``: the Plan's JSON with the conversion record."""
    return dump_json({**plan.to_dict(), "conversion": record.to_dict()})


def dump_json(data: Any) -> str:
    """The JSON text of a written file."""
    return json.dumps(data, indent=2, sort_keys=False, default=str) + "\n"
