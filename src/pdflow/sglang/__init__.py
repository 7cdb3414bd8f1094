"""pdflow as SGLang's KV transfer backend (``--disaggregation-transfer-backend pdflow``).

Install ``pdflow[sglang]`` beside SGLang; SGLang loads :func:`pdflow.sglang.plugin.register`
from the ``sglang.srt.plugins`` entry point in every process. Nothing here is imported by
pdflow itself, so pdflow imports without SGLang. See docs/sglang.md.
"""
