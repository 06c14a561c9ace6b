"""Tokens: the service reads its tokens file again when it changes (a rotated Secret takes effect
without a restart), keeps the tokens it holds when a new file does not load, and the chart puts no
hash of the tokens where anyone who may read a Deployment can see it (issue 49: an unsalted
checksum of them was an annotation of the control plane's pods)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from service import auth
from service.auth import TokenAuth, load_tokens
from tests.helm.tools import render

OLD, NEW = "old-token-0123456789abcdef", "new-token-0123456789abcdef"


def test_a_changed_tokens_file_takes_effect_and_a_broken_one_is_ignored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(auth, "RELOAD_S", 0.0)
    path = tmp_path / "tokens.json"
    path.write_text(json.dumps({OLD: "team-a"}))
    tokens = TokenAuth(load_tokens(path), path)
    assert tokens.tenant(f"Bearer {OLD}") == "team-a"
    # a rotation as the kubelet makes it: a new file in place of the old (another inode)
    fresh = tmp_path / "tokens.new"
    fresh.write_text(json.dumps({NEW: "team-a", "third-token-0123456789ab": "team-b"}))
    os.replace(fresh, path)
    assert tokens.tenant(f"Bearer {OLD}") is None
    assert tokens.tenant(f"Bearer {NEW}") == "team-a"
    assert tokens.tenants == ["team-a", "team-b"]
    # a file that does not load (half written, a typo) leaves the tokens in force
    path.write_text("{not yaml: [")
    assert tokens.tenant(f"Bearer {NEW}") == "team-a"


def test_the_control_plane_pods_carry_no_hash_of_the_tokens() -> None:
    given = {"a-very-long-token-for-a": "team-a"}
    objects = render(values={"tenants": [{"name": "team-a"}], "auth": {"tokens": given}})
    [api] = [o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "fp8rl-api"]
    annotations = api["spec"]["template"]["metadata"].get("annotations") or {}
    digests = {hashlib.sha256(json.dumps(v).encode()).hexdigest() for v in ({"tokens": given},)}
    assert not any(k.startswith("checksum/tokens") for k in annotations), annotations
    assert not digests & set(annotations.values())
