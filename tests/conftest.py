"""Shared fixtures: tiny DeepSeek-V3 configs and random checkpoints in the exact hub layout."""

from __future__ import annotations

import copy
import gc
import os
import shutil
import tempfile

# One on-disk compilation cache for the whole run, shared by this process and every process it
# starts (CLI and script subprocesses, multi-device children, multi-process launches), set before
# JAX starts. The suite compiles the same small programs many times over: in subprocesses, and here
# after each module drops its compiled programs (below); a cache hit skips XLA's compile. Made
# fresh for each run and removed at its end, so nothing carries over between runs.
_JIT_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _JIT_CACHE = tempfile.mkdtemp(prefix="mtp-jax-tests-jit-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _JIT_CACHE
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# The tests compile thousands of tiny programs and run each a few times: LLVM's optimisation of
# the generated CPU code is most of every compile and buys nothing at these sizes (about 30% of the
# suite's time), and XLA:CPU's older loop emitters compile the same HLO about twice as fast as its
# fusion emitters (measured: the embedded model's prefill + step 3.9 s -> 2.1 s of backend compile;
# the suite's pinned tokens are unchanged). One LLVM module per program instead of 32 parts
# (`--xla_cpu_parallel_codegen_split_count=1`): the parts compile in parallel, but each lane of the
# suite has one core, where splitting only adds work (test_eagle3.py 71 -> 62 s, test_dflash.py with
# test_prefill.py 133 -> 118 s, one core each). Every process the tests start inherits them (children
# append their device count). Benchmarks and the package itself never set them.
# Only where the tests run on the CPU: a GPU build of XLA 0.11 exits at start-up (status 1, its
# message lost in pytest's capture of conftest's import) on CPU flags it does not know.
TEST_XLA_FLAGS = (
    "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
    " --xla_cpu_parallel_codegen_split_count=1"
)
# The second lane's worker runs the wide law checks, whose time is running programs, not compiling
# them: at optimisation level 2 (the last level given wins) test_grammar's three law checks took
# 476 -> 267 s and a 16,384-seed generate 9.5 -> 5.5 s (+1.2 s compile); its pinned tokens hold
# (test_embedded_drafts and test_grammar pass at level 2). But most of its tests compile more than
# they run, and level 2 doubles their compile (test_grammar's validity checks 103 -> 47 s at level
# 0): the worker starts with JAX's `jax_disable_most_optimizations` on (level 0 whatever the flags),
# turned off only for tests marked `optimized` (the wide law checks whose time measured shorter at
# level 2; `_optimisation_level` below). Measured on its three modules: 922 s at level 2, 901 at
# level 0, 749 chosen per test. Its inline 8-device child keeps the children's flags.
WORKER_XLA_FLAGS = TEST_XLA_FLAGS + " --xla_backend_optimization_level=2"


def _gpu_plugin_installed() -> bool:
    import importlib.util
    import pkgutil

    if importlib.util.find_spec("jax_plugins") is None:
        return False
    import jax_plugins

    return any("cuda" in m.name or "rocm" in m.name for m in pkgutil.iter_modules(jax_plugins.__path__))


_ON_CPU = os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu" or not _gpu_plugin_installed()
if _ON_CPU and TEST_XLA_FLAGS not in os.environ.get("XLA_FLAGS", ""):  # the second-lane worker has them
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS}".strip()

import jax  # noqa: E402
import pytest  # noqa: E402

gc.set_threshold(20_000, 20, 20)  # see pytest_collection_finish

from mtp_jax.checkpoint.safetensors_io import write_hub_checkpoint  # noqa: E402
from mtp_jax.targets.deepseek_v3.config import DeepseekV3Config  # noqa: E402
from mtp_jax.targets.deepseek_v3.synthetic import hub_tensors, oracle_draft_tensors  # noqa: E402
from tests import spawns  # noqa: E402
from tests.background import SecondLane, in_worker  # noqa: E402
from tests.timeline import Timeline, TimelinePlugin, summary  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def require_extra(module: str, reason: str | None = None):
    """``pytest.importorskip(module)``, except under CI (``CI`` set), where a missing extra is an
    install failure and must fail the run rather than skip its tests."""
    if os.environ.get("CI"):
        import importlib

        return importlib.import_module(module)
    return pytest.importorskip(module, reason=reason)


def real_model(name: str = "smollm2-135m-instruct") -> str:
    """The file of a packaged real model (:data:`mtp_jax.embedded.PACKAGED_MODELS`): skips the test
    where its package is not installed, fails it under CI (which installs it)."""
    from mtp_jax.embedded import packaged_model_path

    try:
        return packaged_model_path(name)
    except FileNotFoundError as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(e))


PARITY_DIR = os.path.join(REPO, "tests", "fixtures", "parity")
EMBEDDED_MODEL = os.path.join(REPO, "checkpoints", "tiny-deepseek-v3-stdlib")

# deepseek-ai/DeepSeek-V3 config.json as published on the hub (the hub-only fields included, since a
# parser that trips over them could not load the real file).
DEEPSEEK_V3_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": {
        "AutoConfig": "configuration_deepseek.DeepseekV3Config",
        "AutoModel": "modeling_deepseek.DeepseekV3Model",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
    },
    "aux_loss_alpha": 0.001,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "ep_size": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "pretraining_tp": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 129280,
}


TINY_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 97,
    "hidden_size": 32,
    "intermediate_size": 48,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 3,
    "num_attention_heads": 3,
    "num_key_value_heads": 3,
    "q_lora_rank": 12,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 4,
    "v_head_dim": 6,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 4,
    "topk_group": 2,
    "first_k_dense_replace": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "hidden_act": "silu",
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 4.0,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 32,
    },
    "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
}


@pytest.fixture
def tiny_config() -> dict:
    """A fresh copy of the tiny hub config.json dict (mutate freely)."""
    return copy.deepcopy(TINY_CONFIG)


@pytest.fixture
def make_checkpoint(tmp_path):
    """make_checkpoint(config_dict=None, name="ckpt", seed=0, shards=1, tensors=None) -> directory."""

    def make(
        config: dict | None = None, name: str = "ckpt", seed: int = 0, shards: int = 1, tensors=None
    ) -> str:
        config = copy.deepcopy(TINY_CONFIG) if config is None else config
        if tensors is None:
            tensors = hub_tensors(DeepseekV3Config.from_dict(config), seed=seed)
        path = str(tmp_path / name)
        write_hub_checkpoint(path, config, tensors, shards=shards)
        return path

    return make


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A float32 model on the tiny config with page_size 4 (many page boundaries), shared per session."""
    import mtp_jax

    path = str(tmp_path_factory.mktemp("tiny") / "ckpt")
    write_hub_checkpoint(path, TINY_CONFIG, hub_tensors(DeepseekV3Config.from_dict(TINY_CONFIG), seed=0))
    return mtp_jax.load(path, dtype="float32", page_size=4)


def oracle_tensors(config: dict, alpha: float, seed: int = 0) -> dict:
    return oracle_draft_tensors(DeepseekV3Config.from_dict(config), alpha, seed)


@pytest.fixture(scope="session")
def oracle_model(tmp_path_factory):
    """A float32 model (tiny config, page size 4) whose MTP draft is accepted often but not always."""
    import mtp_jax

    path = str(tmp_path_factory.mktemp("oracle") / "ckpt")
    write_hub_checkpoint(path, TINY_CONFIG, oracle_tensors(TINY_CONFIG, alpha=0.6))
    return mtp_jax.load(path, dtype="float32", page_size=4)


@pytest.fixture(autouse=True)
def _optimisation_level(request):
    """In the second lane's worker (started at XLA's optimisation level 2 with JAX's "disable most
    optimizations" on), a test marked ``optimized`` compiles at level 2: its time is running
    programs. Compiled programs are dropped where the level changes, so that a marked test never
    runs one compiled at level 0 for an unmarked one (or the reverse)."""
    set_optimisation_level(request.node.get_closest_marker("optimized") is not None)
    yield


def set_optimisation_level(optimized: bool) -> bool:
    """Whether this process (the worker only) changed its level for a test ``optimized`` or not."""
    if not (in_worker() and os.environ.get("JAX_DISABLE_MOST_OPTIMIZATIONS")):
        return False
    if _LEVEL_ZERO[0] != (not optimized):
        jax.clear_caches()
        jax.config.update("jax_disable_most_optimizations", not optimized)
        _LEVEL_ZERO[0] = not optimized
        return True
    return False


_LEVEL_ZERO = [True]  # the worker starts with JAX_DISABLE_MOST_OPTIMIZATIONS=1


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
    """Drop compiled programs after each test module. One process compiles thousands of XLA:CPU
    executables over the suite, each holding JIT-code mappings; without this the full run can
    exhaust the process's memory-map limit (vm.max_map_count) and crash inside a later compile."""
    yield
    jax.clear_caches()
    gc.collect()


# --- the second lane: child checks and offloaded modules in background processes --------------------
# Multi-device checks need XLA_FLAGS before JAX starts, so a test marked ``@pytest.mark.child(CODE,
# *ARGS)`` gets ``python -c CODE ARGS`` run in the background as soon as collection ends (one at a
# time, in test order) and reads its output through the ``child_output`` fixture. After them, the
# tests of the modules below run in one background pytest worker while this process runs the others
# (this process compiles on one core; the second was idle for ~30 of a full run's 60 minutes), and are
# reported here, last, under their own names (the worker runs their child checks when they ask).
# Chosen to even out the two lanes. MTP_JAX_TESTS_ONE_PROCESS=1 runs everything in this process.
SECOND_LANE_MODULES = {  # seconds in the worker at level 2 / chosen per test (fresh clone of 2ffb4ab)
    "tests/test_acceptance.py",  # 603 / 518 (its law checks at their power: 12-20k seeds a case)
    "tests/test_grammar.py",  # 235 / 167 (its child check runs in the worker)
    "tests/test_embedded_drafts.py",  # 83 / 64
    "tests/targets/test_gemma3.py",  # 83 in the main lane (compiling: level 0 in the worker too)
}
# Back in the main lane since f578e6e's run, where the worker (started after the 8-device children,
# 1,620 s in) ended 11 minutes after the main lane: test_prefill.py 126 s, test_serving.py 150 s,
# test_server.py 111 s. They compile more than they run, which the worker's optimisation level 2
# made slower then; the worker now compiles unmarked tests at level 0 like this process, so a module
# that compiles can go there too (one whose tests start processes inherits the level-0 setting).

_LANE = SecondLane(REPO, TEST_XLA_FLAGS, WORKER_XLA_FLAGS if _ON_CPU else None)
_LANE.timeline = Timeline.from_env("worker" if in_worker() else "main")  # tests/timeline.py


def _offload_wanted(config) -> bool:
    return not (
        os.environ.get("MTP_JAX_TESTS_ONE_PROCESS")
        or in_worker()
        or (os.cpu_count() or 1) < 2
        or config.option.collectonly
        or config.option.usepdb
        or config.pluginmanager.has_plugin("tests.compile_counts")  # it counts this process's compiles
    )


@pytest.hookimpl(trylast=True)  # after -k / -m deselected what they deselect
def pytest_collection_modifyitems(session, config, items) -> None:
    if not config.option.collectonly:
        offload = SECOND_LANE_MODULES if _offload_wanted(config) else set()
        items[:] = _LANE.start(items, offload, config, background=not in_worker())


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    return True if _LANE.replay(item) else None


spawns.install()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item) -> None:
    spawns.enter(item.nodeid)  # before its fixtures: a server fixture set up for it counts too


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if call.when == "teardown":
        problem = spawns.leave(item)
        report = outcome.get_result()
        if problem is not None and report.passed:
            report.outcome, report.longrepr = "failed", problem


def pytest_collection_finish(session) -> None:
    # Python's cyclic collector walks every live object on each full collection, and the suite keeps
    # many alive (its modules, fixtures, JAX's caches): at the default thresholds it ran ~215 full
    # collections, ~110 s of the run's main process. What exists once the tests are collected lives
    # to the end, so leave it out of collections from here on (gc.freeze), and collect less often
    # while tracing allocates its short-lived objects (the threshold set at import); each module's
    # end still collects in full (_release_compiled_programs).
    gc.collect()
    gc.freeze()
    if _LANE.timeline is not None:
        replayed = lambda item: item.nodeid in _LANE.offloaded  # noqa: E731 (the worker records them)
        session.config.pluginmanager.register(TimelinePlugin(_LANE.timeline, replayed), "timeline")


def pytest_sessionfinish(session) -> None:
    _LANE.stop()  # an interrupted run leaves no background process behind
    timeline = session.config.pluginmanager.get_plugin("timeline")
    if timeline is not None:
        timeline.finish()
        if not in_worker():
            print("\n" + summary(_LANE.timeline.path))
    if _JIT_CACHE is not None:
        shutil.rmtree(_JIT_CACHE, ignore_errors=True)


@pytest.fixture
def child_output(request) -> str:
    """The stdout of this test's ``child`` process (started in the background at collection's end);
    fails the test with the child's stderr when it exited with an error."""
    return _LANE.child_output(request.node.nodeid)


def greedy_reference(ref) -> tuple[list[list[int]], int, list[list[int]]]:
    """(prompts, new tokens, expected tokens) of a parity fixture's ``greedy`` array: the reference's
    greedy ``generate`` from ``input_ids[:, :prompt_length]``, ``new_tokens`` long."""
    p, n = int(ref["prompt_length"]), int(ref["new_tokens"])
    return [[int(t) for t in row[:p]] for row in ref["input_ids"]], n, ref["greedy"][:, p:].tolist()


def cli_run(capsys, *argv: str) -> tuple[int, str]:
    """``mtp-jax ARGV`` in this process (the console script itself is run by
    tests/test_cli.py): its exit status (argparse's refusals included) and its stdout + stderr."""
    from mtp_jax.cli import main

    try:
        code = main(list(argv))
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return code, out + err


def assert_speculated(stats: dict, label: object = None) -> None:
    """Drafts were proposed and some accepted (``stats``: a result's ``stats`` or one request's):
    a losslessness check over a run that never proposed, or rejected every draft, proves nothing
    about the acceptance path."""
    assert stats["num_draft_tokens"] > 0, ("no draft was proposed", label)
    assert stats["num_accepted_tokens"] > 0, ("no draft was accepted", label)
    assert stats["acceptance_length"] > 1, label


def check_lossless(
    model, draft: str, prompts: list, ks, plain_tokens: list | None = None, *, unaccepted: str = "", **kw
) -> list:
    """Greedy speculation with ``draft`` at each K of ``ks`` (three slots, ``kw``: e.g.
    max_new_tokens) gives plain decoding's tokens (``plain_tokens``, or decoded here), with drafts
    accepted at every K (:func:`assert_speculated`) unless ``unaccepted`` says why this target
    never accepts them (a random draft on a foreign target: then only the proposal is asserted).
    Returns the speculative results, in ``ks`` order."""
    kw = {"max_new_tokens": 14, "ignore_eos": True, "max_batch": 3, **kw}
    if plain_tokens is None:
        plain_tokens = model.generate(prompts, **kw).tokens
    outs = []
    for k in ks:
        out = model.generate(prompts, draft=draft, num_speculative_tokens=k, **kw)
        assert out.tokens == plain_tokens, (draft, k)
        if unaccepted:
            assert out.stats["num_draft_tokens"] > 0, (draft, k)
        else:
            assert_speculated(out.stats, (draft, k))
        outs.append(out)
    return outs


def check_per_request_k(model, draft: str, prompts: list, plain_tokens: list) -> None:
    """Requests with their own K (one of them 0: plain) sharing three slots (the batch the callers'
    other runs compile) give plain decoding's tokens, the K = 0 request verifies no drafts, each
    other one at most its K a step (and some, unless its draft proposes per row: an n-gram row
    whose text never matched has none), and drafts are accepted."""
    from mtp_jax.drafts import draft_for

    ks = [3, 0, 1, 2][: len(prompts)]
    mixed = model.generate(
        prompts, max_new_tokens=14, ignore_eos=True, max_batch=3, draft=draft, num_speculative_tokens=ks
    )
    assert mixed.tokens == plain_tokens
    per_row = draft_for(draft).proposes_per_row
    for r, k in zip(mixed.request_stats, ks, strict=True):
        assert r["num_draft_tokens"] <= k * r["steps"], (draft, k, r)
        assert (r["num_draft_tokens"] > 0 or per_row) if k else r["num_draft_tokens"] == 0, (draft, k, r)
    assert_speculated(mixed.stats, (draft, ks))
