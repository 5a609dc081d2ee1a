"""The protocol's contract (its OpenAPI document), for checking answers against it."""

from __future__ import annotations

from pathlib import Path

import yaml
from jsonschema import Draft202012Validator

# The contract lives in ../shared/spec/ beside the checkout; a copy travels with
# the tests for checkouts without it. The shared one wins when it is there.
_SHARED_SPEC = Path(__file__).resolve().parents[3] / "shared" / "spec" / "code-execution-openapi.yaml"
_VENDORED_SPEC = Path(__file__).resolve().parent / "spec" / "code-execution-openapi.yaml"


def load_contract() -> dict:
    path = _SHARED_SPEC if _SHARED_SPEC.exists() else _VENDORED_SPEC
    return yaml.safe_load(path.read_text())


def schema_checker(contract: dict):
    """``check("ExecResponse", body)`` lists where ``body`` breaks the contract."""

    def check(schema_name: str, payload: object) -> list[str]:
        validator = Draft202012Validator(
            {"$ref": f"#/components/schemas/{schema_name}", "components": contract["components"]})
        return [f"{'.'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}"
                for e in validator.iter_errors(payload)]

    return check
