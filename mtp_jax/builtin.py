"""The shipped targets and drafts, registered through the same calls a plug-in uses
(:func:`mtp_jax.targets.register_target`, :func:`mtp_jax.drafts.register_draft`): one
registration each. Each lives in a folder of its own (``targets/<family>/``, ``drafts/<name>/``)
holding its model code, config, checkpoint key map and its pieces of the tools; nothing else in the
package names it. Importing :mod:`mtp_jax` runs this module."""

from __future__ import annotations

from mtp_jax.drafts import register_draft
from mtp_jax.drafts.dflash.draft import DRAFT as DFLASH
from mtp_jax.drafts.draft_model.draft import DRAFT as DRAFT_MODEL
from mtp_jax.drafts.dspark.draft import DRAFT as DSPARK
from mtp_jax.drafts.eagle3.draft import DRAFT as EAGLE3
from mtp_jax.drafts.mtp.draft import DRAFT as MTP
from mtp_jax.drafts.ngram.draft import DRAFT as NGRAM
from mtp_jax.drafts.suffix.draft import DRAFT as SUFFIX
from mtp_jax.drafts.suffix.hybrid import hybrid
from mtp_jax.targets import register_target
from mtp_jax.targets.deepseek_v3 import checkpoint as deepseek_v3_checkpoint
from mtp_jax.targets.deepseek_v3.config import DEEPSEEK_V3_MODEL_TYPES, parse_deepseek_v3
from mtp_jax.targets.deepseek_v3.model import TARGET as DEEPSEEK_V3
from mtp_jax.targets.gemma3 import checkpoint as gemma3_checkpoint
from mtp_jax.targets.gemma3.config import GEMMA3_MODEL_TYPES, parse_gemma3
from mtp_jax.targets.gemma3.gguf import GEMMA3_GGUF
from mtp_jax.targets.gemma3.model import TARGET as GEMMA3
from mtp_jax.targets.llama import checkpoint as llama_checkpoint
from mtp_jax.targets.llama.config import LLAMA_MODEL_TYPES, parse_llama3, parse_qwen
from mtp_jax.targets.llama.gguf import LLAMA_GGUF
from mtp_jax.targets.llama.model import TARGET as LLAMA
from mtp_jax.targets.llama.qwen2 import TARGET as QWEN2
from mtp_jax.targets.llama.qwen3 import TARGET as QWEN3

register_target(
    DEEPSEEK_V3,
    model_types=DEEPSEEK_V3_MODEL_TYPES,
    parse=parse_deepseek_v3,
    checkpoint_format=deepseek_v3_checkpoint,
    built_in=True,
)
register_target(
    LLAMA,
    model_types=LLAMA_MODEL_TYPES,
    parse=parse_llama3,
    checkpoint_format=llama_checkpoint,
    gguf=LLAMA_GGUF,  # llama, qwen2 and qwen3 GGUF files
    built_in=True,
)
# Qwen2 and Qwen3 are Llama-family configs: Llama's key map reads them
register_target(QWEN2, model_types=("qwen2",), parse=parse_qwen, built_in=True)
register_target(QWEN3, model_types=("qwen3",), parse=parse_qwen, built_in=True)
register_target(
    GEMMA3,
    model_types=GEMMA3_MODEL_TYPES,
    parse=parse_gemma3,
    checkpoint_format=gemma3_checkpoint,
    gguf=GEMMA3_GGUF,
    built_in=True,
)

register_draft(MTP)
register_draft(DSPARK)  # before EAGLE-3, which reads any other draft config with an fc
register_draft(EAGLE3)
register_draft(DFLASH)
register_draft(NGRAM)
register_draft(SUFFIX)
register_draft(DRAFT_MODEL)  # last of those read from a directory: it recognises any target checkpoint
for neural in (MTP, EAGLE3, DFLASH, DSPARK, DRAFT_MODEL):  # suffix decoding with a neural fallback
    register_draft(hybrid(neural))
