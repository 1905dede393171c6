"""`Runtime` under the name `localrt serve` imports it by (localrt/cli/serve.py); everything else
imports it from `localrt.runtime.generate`, where it is defined."""

from __future__ import annotations

from localrt.runtime.generate import Runtime

__all__ = ["Runtime"]
