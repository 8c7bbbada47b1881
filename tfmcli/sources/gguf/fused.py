"""GGUF architectures whose attention weights the converter keeps fused or transposed:
StarCoder (gpt_bigcode), GPT-NeoX, Falcon, BLOOM and MPT. Each an ``archs.Arch``, registered in
``ARCHS``."""

from __future__ import annotations

ARCHS: dict = {}   # general.architecture -> archs.Arch
