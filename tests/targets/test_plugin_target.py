"""A target defined outside the package (here, in this file) and registered with one
``mtp_jax.plugins.register_target`` call runs everywhere a shipped one does: ``load`` (its own
``model_type`` in config.json), ``generate`` plain and with drafts, the engine, the CLI
(``generate``, ``inspect``, ``plan``), the size estimate and the roofline, with no edit to the
package."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import pytest

import mtp_jax
from mtp_jax import config as config_module
from mtp_jax import targets as targets_module
from mtp_jax.checkpoint import formats
from mtp_jax.cli import main
from mtp_jax.estimate import count_parameters, format_report
from mtp_jax.plugins import register_target
from mtp_jax.roofline import step_bytes
from mtp_jax.targets import target_for
from mtp_jax.targets.llama import checkpoint as llama3_format
from mtp_jax.targets.llama.config import Llama3Config, parse_llama_family
from mtp_jax.targets.llama.model import family_target
from tests.conftest import REPO

LLAMA = os.path.join(REPO, "checkpoints", "tiny-llama3-stdlib")
EAGLE3 = os.path.join(REPO, "checkpoints", "tiny-llama3-stdlib-eagle3")


@dataclasses.dataclass(frozen=True)
class PlugConfig(Llama3Config):
    """A Llama-family model under a model_type of its own."""

    model_type: str = "plugin_llama"


def _parse(raw: dict) -> PlugConfig:
    return parse_llama_family(raw, PlugConfig, "Plug-in Llama")


PLUG = family_target("plugin_llama", PlugConfig, title="Plug-in Llama")


@pytest.fixture
def plugin(monkeypatch, tmp_path):
    """PLUG registered (the registries restored afterwards) and a checkpoint that names it."""
    monkeypatch.setattr(targets_module, "TARGETS", targets_module.TARGETS)
    monkeypatch.setattr(config_module, "_PARSERS", dict(config_module._PARSERS))
    monkeypatch.setattr(formats, "_FORMATS", list(formats._FORMATS))
    register_target(PLUG, model_types=("plugin_llama",), parse=_parse, checkpoint_format=llama3_format)
    path = tmp_path / "plug"
    shutil.copytree(LLAMA, path)
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, "model_type": "plugin_llama"}))
    return str(path)


PROMPTS = [[8, 8, 8, 8, 8], [5, 9, 17, 3], [40, 2, 2, 7]]


def test_a_registered_target_runs_everywhere_a_shipped_one_does(plugin, capsys):
    base = mtp_jax.load(LLAMA, "float32", page_size=4)
    model = mtp_jax.load(plugin, "float32", page_size=4, draft_model=EAGLE3)
    assert type(model.config) is PlugConfig and target_for(model.config) is PLUG
    plain = base.generate(PROMPTS, max_new_tokens=10, ignore_eos=True).tokens
    assert model.generate(PROMPTS, max_new_tokens=10, ignore_eos=True).tokens == plain
    # n-gram lookup proposes only where the text repeats: each prompt, its continuation, the prompt again
    echo = [p + c + p for p, c in zip(PROMPTS, plain, strict=True)]
    echo_plain = base.generate(echo, max_new_tokens=10, ignore_eos=True).tokens
    for draft, k, prompts, want in (("ngram", 3, echo, echo_plain), ("eagle3", 2, PROMPTS, plain)):
        spec = model.generate(
            prompts, max_new_tokens=10, ignore_eos=True, draft=draft, num_speculative_tokens=k
        )
        assert spec.tokens == want and spec.stats["num_draft_tokens"] > 0, draft
    with mtp_jax.Engine(model, slots=2, max_len=32, draft="eagle3", num_speculative_tokens=2) as engine:
        handles = [engine.submit(p, max_new_tokens=10, ignore_eos=True) for p in PROMPTS]
        assert [list(h.result(timeout=120).tokens) for h in handles] == plain
    # the estimates and the roofline read its declaration (the Llama family's)
    assert count_parameters(model.config) == count_parameters(base.config)
    assert "Plug-in Llama" in format_report(model.config, "fp32", {}, 64)
    got = step_bytes(model.params, model.config, k=0, batch=1, context=4, cache_itemsize=4)
    assert got == step_bytes(base.params, base.config, k=0, batch=1, context=4, cache_itemsize=4)
    # the CLI
    argv = ["--model", plugin, "--draft", "ngram", "-k", "2", "--max-new-tokens", "6"]
    assert main(["generate", *argv, "--prompt", "def f(x):"]) == 0
    capsys.readouterr()
    assert main(["inspect", plugin]) == 0
    assert "Model: plugin_llama (Plug-in Llama)" in capsys.readouterr().out
    planned = ["-k", "0", "--mesh", "data=1", "--batch", "2", "--max-len", "32", "--weights", "bf16"]
    assert main(["plan", plugin, *planned]) == 0
    assert "plain (K=0)" in capsys.readouterr().out


def test_registration_is_checked(monkeypatch):
    monkeypatch.setattr(targets_module, "TARGETS", targets_module.TARGETS)
    monkeypatch.setattr(config_module, "_PARSERS", dict(config_module._PARSERS))
    with pytest.raises(TypeError, match="takes a mtp_jax.targets.Target"):
        register_target("plugin_llama")
    with pytest.raises(ValueError, match="Llama3Config is the config of a built-in target"):
        register_target(dataclasses.replace(PLUG, config_class=Llama3Config))
    with pytest.raises(ValueError, match="model_types need parse"):
        register_target(PLUG, model_types=("plugin_llama",))
    with pytest.raises(ValueError, match="'llama' is built in"):
        register_target(PLUG, model_types=("llama",), parse=_parse)
    with pytest.raises(
        mtp_jax.ConfigError, match="unsupported model_type 'plugin_llama'; supported: deepseek_v3"
    ):
        config_module.parse_config({"model_type": "plugin_llama"})
