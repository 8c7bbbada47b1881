"""GGUF architectures of LLaMA's layout with their own conventions: Gemma, Gemma 2, Gemma 3 (norms
stored as ``1 + w``), Phi-3 and StableLM. Each an ``archs.Arch``, registered in ``ARCHS``."""

from __future__ import annotations

ARCHS: dict = {}   # general.architecture -> archs.Arch
