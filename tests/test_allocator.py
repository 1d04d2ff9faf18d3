"""The CPU allocator setting: applied on glibc, skipped when the user turns it off."""

from __future__ import annotations

import platform

from tpflow.train.allocator import keep_freed_memory


def test_keep_freed_memory_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("TPFLOW_KEEP_FREED_MEMORY", "0")
    assert keep_freed_memory() is False


def test_keep_freed_memory_applies_on_glibc(monkeypatch):
    monkeypatch.delenv("TPFLOW_KEEP_FREED_MEMORY", raising=False)
    expected = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
    assert keep_freed_memory() is expected
