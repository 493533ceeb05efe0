"""Checkpoints: exact round-trip, never written from a bad state, crash-safe, corruption detected, no code run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import stabletrain
from stabletrain.config import config_to_dict
from stabletrain.records.checkpoint.files import CheckpointError, first_nonfinite, load_state_file
from stabletrain.records.checkpoint.manager import CheckpointManager
from stabletrain.seeding import set_rng_state

MLP = ["task=mlp", "train.max_steps=3", "log.every=1", "log.progress=false"]


def tiny_state(value: float) -> dict:
    """A small state shaped like Trainer.state_dict(): model, optimizer, metrics, RNG tuple, counters."""
    return {
        "model": {"w": torch.full((4, 3), value), "b": torch.zeros(3)},
        "optimizer": {"state": {0: {"step": torch.tensor(1.0), "exp_avg": torch.full((4, 3), value)}},
                      "param_groups": [{"lr": 0.1, "params": [0]}]},
        "metrics": {"buf": torch.tensor([float("nan")])},  # a skipped step's NaN loss: recorded, not a bad state
        "rng": {"python": (3, tuple(range(5)), None), "torch": torch.Generator().manual_seed(0).get_state()},
        "counters": {"step": int(value), "tokens_seen": 1.5},
    }


def assert_same(a, b, path: str = "state") -> None:
    """Assert two nested states are identical: tensors bitwise (and dtype), everything else by ==."""
    assert type(a) is type(b), path
    if isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}.{i}")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        bits = lambda t: t.reshape(-1).view(torch.uint8) if t.is_floating_point() else t  # noqa: E731
        assert torch.equal(bits(a), bits(b)), path  # bitwise, so NaN == NaN and -0.0 != 0.0
    else:
        assert a == b, path


def dirs(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


# -- round trip ------------------------------------------------------------------------------------


def test_trainer_state_round_trips_bitwise_and_the_next_step_matches(tmp_path):
    cfg = stabletrain.load_config(None, MLP)
    a = stabletrain.Trainer(cfg)
    a.fit()
    saved = a.state_dict()
    manager = CheckpointManager(tmp_path / "checkpoints")
    res = manager.save(saved, a.step, {"config": config_to_dict(cfg)})
    assert not res.withheld and res.path == tmp_path / "checkpoints" / "step_000003"

    loaded = manager.load()
    assert loaded.path == res.path and loaded.problems == []
    assert loaded.meta["step"] == 3 and loaded.meta["config"] == config_to_dict(cfg)
    assert isinstance(loaded.state["rng"]["python"], tuple)  # random.getstate() survives weights_only
    assert_same(saved, loaded.state)

    b = stabletrain.Trainer(cfg)
    b.load_state_dict(loaded.state)
    assert_same(b.state_dict(), saved)

    b.train_step(b.stream.next_window())
    set_rng_state(saved["rng"])  # building b reseeded the global RNGs; give a the same draws
    a.train_step(a.stream.next_window())
    for (name, pa), pb in zip(a.named_params, b.params):
        assert torch.equal(pa, pb), name
    assert_same(a.optimizer.state_dict(), b.optimizer.state_dict())

    name, param = a.named_params[-1]
    with torch.no_grad():
        param.view(-1)[0] = float("nan")
    res = manager.save(a.state_dict(), a.step, {"config": config_to_dict(cfg)})
    assert res.withheld and f"model.{name} is not finite" in res.reason
    assert dirs(tmp_path / "checkpoints") == ["LAST_GOOD", "step_000003"]


def test_meta_json_records_hash_size_and_caller_keys(tmp_path):
    manager = CheckpointManager(tmp_path)
    res = manager.save(tiny_state(1.0), 7, {"config_hash": "abc"})
    meta = json.loads((res.path / "meta.json").read_text())
    assert meta["step"] == 7 and meta["config_hash"] == "abc"
    assert meta["state_bytes"] == (res.path / "state.pt").stat().st_size == res.num_bytes
    assert meta["versions"]["torch"] == torch.__version__
    assert (tmp_path / "LAST_GOOD").read_text() == "step_000007\n"
    with pytest.raises(ValueError, match="step"):
        manager.save(tiny_state(1.0), 8, {"step": 3})


# -- never from a bad state ------------------------------------------------------------------------


@pytest.mark.parametrize("where, plant", [
    ("model.b", lambda s: s["model"]["b"].__setitem__(1, float("nan"))),
    ("optimizer.state.0.exp_avg", lambda s: s["optimizer"]["state"][0]["exp_avg"].__setitem__((2, 2), float("inf"))),
    ("optimizer.param_groups.0.lr", lambda s: s["optimizer"]["param_groups"][0].__setitem__("lr", float("nan"))),
])
def test_nonfinite_state_is_withheld_and_nothing_is_written(tmp_path, where, plant):
    manager = CheckpointManager(tmp_path)
    manager.save(tiny_state(1.0), 1)
    before = dirs(tmp_path)
    state = tiny_state(2.0)
    plant(state)
    res = manager.save(state, 2)
    assert res.withheld and res.path is None and res.kind == "checkpoint_withheld"
    assert where in res.reason and "step_000001" in res.reason
    assert dirs(tmp_path) == before
    assert manager.latest_good() == tmp_path / "step_000001"


def test_finiteness_check_is_exact():
    state = tiny_state(1.0)
    state["optimizer"]["state"][0]["exp_avg"] = torch.full((8,), 1e30)  # its L2 norm overflows; it is finite
    state["model"]["h"] = torch.tensor([1.0, 60000.0], dtype=torch.float16)
    assert first_nonfinite(state, ("model", "optimizer")) is None
    assert first_nonfinite(state) == "metrics.buf"  # scope None checks everything
    state["model"]["b"][0] = float("-inf")
    state["optimizer"]["state"][0]["exp_avg"][3] = float("nan")
    assert first_nonfinite(state, ("model", "optimizer")) == "model.b"  # the first in walk order
    with pytest.raises(ValueError, match="'model'"):
        first_nonfinite({"params": torch.zeros(1)}, ("model",))


# -- crash safety ----------------------------------------------------------------------------------

CRASH = textwrap.dedent("""
    import os, signal, sys, torch
    sys.path.insert(0, {tests!r})
    from test_checkpoint import tiny_state
    from stabletrain.records.checkpoint.manager import CheckpointManager

    root, mode = sys.argv[1], sys.argv[2]
    m = CheckpointManager(root)
    m.save(tiny_state(1.0), 1)
    m.save(tiny_state(2.0), 2)
    die = lambda: os.kill(os.getpid(), signal.SIGKILL)
    real_save, real_replace = torch.save, os.replace

    def half_save(obj, f, *a, **k):  # dies in the middle of writing state.pt
        import io
        buf = io.BytesIO(); real_save(obj, buf, *a, **k); data = buf.getvalue()
        f.write(data[: len(data) // 2]); f.flush(); die()

    def dying_replace(src, dst):
        # "rename": dies renaming the checkpoint directory into place (not a file inside it)
        if (mode == "last_good" and os.path.basename(dst) == "LAST_GOOD") or (
                mode != "last_good" and ".tmp-" in str(src) and os.path.basename(dst).startswith("step_")):
            die()
        return real_replace(src, dst)

    if mode == "torch_save":
        from stabletrain.records.checkpoint import checksummed
        torch.save = checksummed.save_without_record_crcs = half_save
    else:
        os.replace = dying_replace
    m.save(tiny_state(9.0), 2 if mode == "resave" else 3)
""")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["torch_save", "rename", "last_good", "resave"])
def test_crash_mid_save_leaves_last_good_on_the_previous_checkpoint(tmp_path, mode):
    root = tmp_path / "checkpoints"
    script = CRASH.format(tests=str(Path(__file__).parent))
    proc = subprocess.run([sys.executable, "-c", script, str(root), mode], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr

    manager = CheckpointManager(root)
    assert (root / "LAST_GOOD").read_text() == "step_000002\n"
    problems: list[str] = []
    loaded = manager.load(on_problem=problems.append)
    assert loaded.meta["step"] == 2
    assert_same(loaded.state, tiny_state(2.0))  # the resave crashed after moving step_000002 aside: still found
    assert loaded.problems == problems
    if mode == "last_good":  # step_000003 was written and verified but never marked good
        assert len(problems) == 1 and problems[0].startswith("step_000003: newer than LAST_GOOD (step_000002); not used")
    else:
        assert problems == []

    res = manager.save(tiny_state(4.0), 4)  # the next save cleans up after the dead writer
    assert res.path.name == "step_000004"
    assert not [n for n in dirs(root) if "-" in n], dirs(root)
    assert_same(manager.load(root / "step_000002").state, tiny_state(2.0))


def test_failed_write_raises_and_leaves_everything_as_it_was(tmp_path, monkeypatch):
    manager = CheckpointManager(tmp_path)
    manager.save(tiny_state(1.0), 1)
    before = {p.name: p.stat().st_mtime_ns for p in tmp_path.rglob("*")}

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(CheckpointError, match=r"No space left on device.*step_000001.*untouched"):
        manager.save(tiny_state(2.0), 2)
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.rglob("*")} == before


# -- corruption ------------------------------------------------------------------------------------


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, expect", [
    (truncate, "truncated"),
    (flip_byte, "does not match its crc32"),
    (lambda p: p.unlink(), "state.pt is missing"),
    (lambda p: (p.parent / "meta.json").write_text("{"), "meta.json is unreadable"),
])
def test_corrupted_newest_checkpoint_is_reported_and_the_previous_used(tmp_path, damage, expect):
    manager = CheckpointManager(tmp_path)
    manager.save(tiny_state(1.0), 1)
    manager.save(tiny_state(2.0), 2)
    damage(tmp_path / "step_000002" / "state.pt")
    assert manager.verify(tmp_path / "step_000001") == []
    assert expect in manager.verify(tmp_path / "step_000002")[0]

    seen: list[str] = []
    loaded = manager.load(on_problem=seen.append)
    assert loaded.path.name == "step_000001"
    assert_same(loaded.state, tiny_state(1.0))
    assert len(seen) == 1 and seen[0].startswith("step_000002: ") and expect in seen[0]

    with pytest.raises(CheckpointError, match="step_000002"):  # an explicit path never falls back
        manager.load(tmp_path / "step_000002")
    damage(tmp_path / "step_000001" / "state.pt")
    with pytest.raises(CheckpointError, match="verifies") as err:
        manager.load()
    assert [p.split(":")[0] for p in err.value.problems] == ["step_000002", "step_000001"]


def test_state_pt_is_checksummed_whole_as_written_and_loads_as_any_torch_save(tmp_path):
    import zipfile
    import zlib

    manager = CheckpointManager(tmp_path)
    manager.save_async(tiny_state(1.0), 1).result()
    meta = json.loads((tmp_path / "step_000001" / "meta.json").read_text())
    data = (tmp_path / "step_000001" / "state.pt").read_bytes()
    assert meta["format"] == 2 and "state_sha256" not in meta
    assert meta["state_crc32"] == f"{zlib.crc32(data):08x}" and meta["state_bytes"] == len(data)
    # torch.save's per-record CRC32 is left out (the file's own CRC32 covers every byte); torch.load reads it
    assert {info.CRC for info in zipfile.ZipFile(tmp_path / "step_000001" / "state.pt").infolist()} == {0}
    assert_same(torch.load(tmp_path / "step_000001" / "state.pt", weights_only=True), tiny_state(1.0))


def test_a_format_1_checkpoint_with_a_sha256_still_loads_and_a_newer_format_is_refused(tmp_path):
    import hashlib

    manager = CheckpointManager(tmp_path)
    manager.save(tiny_state(1.0), 1)
    meta_path, state_pt = tmp_path / "step_000001" / "meta.json", tmp_path / "step_000001" / "state.pt"
    meta = json.loads(meta_path.read_text())
    old = {k: v for k, v in meta.items() if k != "state_crc32"}
    old.update(format=1, state_sha256=hashlib.sha256(state_pt.read_bytes()).hexdigest())
    meta_path.write_text(json.dumps(old))
    assert manager.verify(tmp_path / "step_000001") == []
    assert_same(manager.load().state, tiny_state(1.0))
    meta_path.write_text(json.dumps({**meta, "format": 3}))
    assert "meta.json is format 3, newer than this stabletrain reads (2" in manager.verify(tmp_path / "step_000001")[0]
    meta_path.write_text(json.dumps(old))
    flip_byte(state_pt)
    assert "state.pt does not match its sha256 in meta.json" in manager.verify(tmp_path / "step_000001")[0]


def test_missing_last_good_falls_back_to_the_newest_that_verifies(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(tiny_state(1.0), 1)
    manager.save(tiny_state(2.0), 2)
    (tmp_path / "LAST_GOOD").unlink()
    loaded = manager.load()
    assert loaded.path.name == "step_000002" and "LAST_GOOD: missing" in loaded.problems[0]
    with pytest.raises(CheckpointError, match="no checkpoint in"):
        CheckpointManager(tmp_path / "empty").load()


# -- keep-N ----------------------------------------------------------------------------------------


def test_keep_newest_and_never_delete_last_good(tmp_path, monkeypatch):
    manager = CheckpointManager(tmp_path, keep=2)
    for step in range(1, 6):
        res = manager.save(tiny_state(float(step)), step)
    assert res.pruned == (tmp_path / "step_000003",)
    assert dirs(tmp_path) == ["LAST_GOOD", "step_000004", "step_000005"]

    # step 6 is written but LAST_GOOD cannot move: step_000005 stays good and is never pruned
    def cannot_point(self, name):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(CheckpointManager, "_point_last_good", cannot_point)
    with pytest.raises(CheckpointError, match="step_000006 was written and verified.*LAST_GOOD still names step_000005"):
        manager.save(tiny_state(6.0), 6)
    monkeypatch.undo()
    assert CheckpointManager(tmp_path, keep=1).prune() == [tmp_path / "step_000004"]
    assert dirs(tmp_path) == ["LAST_GOOD", "step_000005", "step_000006"]
    assert manager.load().path.name == "step_000005"

    assert manager.discard_after(5) == [tmp_path / "step_000006"]  # a rollback drops the never-good one
    assert dirs(tmp_path) == ["LAST_GOOD", "step_000005"]


def test_resave_at_the_same_step_replaces_it(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(tiny_state(1.0), 1)
    manager.save(tiny_state(2.0), 1)
    assert dirs(tmp_path) == ["LAST_GOOD", "step_000001"]
    assert_same(manager.load().state, tiny_state(2.0))


# -- no code execution -----------------------------------------------------------------------------


RAN: list[str] = []


def mark_ran() -> None:
    RAN.append("payload")


class Payload:
    def __reduce__(self):
        return (mark_ran, ())  # unpickling would call mark_ran()


def plant_checkpoint(directory: Path, obj) -> None:
    """Write a checkpoint directory by hand, with a meta.json whose hash matches (as a forger would)."""
    import hashlib

    directory.mkdir(parents=True)
    torch.save(obj, directory / "state.pt")
    data = (directory / "state.pt").read_bytes()
    (directory / "meta.json").write_text(json.dumps({"step": 9, "state_sha256": hashlib.sha256(data).hexdigest(),
                                                      "state_bytes": len(data)}))


def test_a_file_that_needs_more_than_weights_only_is_refused(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(tiny_state(1.0), 1)
    plant_checkpoint(tmp_path / "step_000009", {"model": {"w": torch.zeros(1)}, "optimizer": {}, "x": Payload()})
    (tmp_path / "LAST_GOOD").write_text("step_000009\n")

    refused = r"state\.pt refused: it pickles the global \S*mark_ran, so loading it would execute code"
    with pytest.raises(CheckpointError, match=refused):
        manager.load(tmp_path / "step_000009")
    with pytest.raises(CheckpointError, match=r"step_000009/state\.pt: refused"):
        load_state_file(tmp_path / "step_000009" / "state.pt")
    loaded = manager.load()  # falls back, saying why
    assert loaded.path.name == "step_000001" and "execute code" in loaded.problems[0]
    assert RAN == []



# -- background saves ------------------------------------------------------------------------------


def test_stage_reuses_its_buffers_and_copies_what_could_change(tmp_path):
    from stabletrain.records.staging import StateStager

    stager = StateStager()
    state = {"model": {"w": torch.ones(3), "tied": None}, "skip": {(0, 1)}, "counters": {"step": 1}}
    state["model"]["tied"] = state["model"]["w"]
    staged, events = stager.stage(state)
    assert events == []  # CPU: nothing to wait for
    assert staged["model"]["w"] is staged["model"]["tied"] and staged["model"]["w"] is not state["model"]["w"]
    ptr = staged["model"]["w"].data_ptr()
    state["model"]["w"].fill_(5.0)
    state["skip"].add((1, 2))
    state["counters"]["step"] = 2
    assert torch.equal(staged["model"]["w"], torch.ones(3)) and staged["skip"] == {(0, 1)}
    assert staged["counters"]["step"] == 1
    again, _ = stager.stage(state)
    assert again["model"]["w"].data_ptr() == ptr and torch.equal(again["model"]["w"], torch.full((3,), 5.0))
    assert stager.num_bytes == 3 * 4


def test_stage_reuses_its_plan_for_the_same_parameters_and_walks_again_when_they_change():
    """The parameters and optimizer state (a dict of dicts of tensors), staged again with the same tensors: the same
    buffers and containers, the new values; a tensor replaced (another address or shape), a key added, another share,
    a plain value among them, a tie undone or made another view: a fresh walk, and the staged values are the live ones."""
    from stabletrain.records.staging import StateStager, Withheld, equal_states

    live = {"w": torch.randn(6, 4), "b": torch.randn(6), "m": torch.randn(6, 4), "step": torch.tensor(1.0)}

    def side(tied: bool = True) -> dict:  # new tensor objects each time, as a state_dict() makes them (detach)
        t = {k: v.detach() for k, v in live.items()}
        return {"model": {"emb": t["w"], "head": t["w"] if tied else t["m"], "b": t["b"]},
                "optimizer": {0: {"exp_avg": t["m"], "step": t["step"]}}}

    stager = StateStager()
    first, _ = stager.stage(side())
    assert first["model"]["emb"] is first["model"]["head"] and equal_states(first, side())  # the tie: one buffer
    buffers = [id(t) for t in first["model"].values()]
    for t in live.values():
        t.mul_(2.0)  # a step in place
    again, _ = stager.stage(side())
    assert again is first and equal_states(again, side())  # the plan reused: the same containers, today's values
    assert [id(t) for t in again["model"].values()] == buffers
    live["b"] = torch.zeros(6)  # replaced: another tensor at another address
    third, _ = stager.stage(side())
    assert third is not first and equal_states(third, side()) and torch.equal(third["model"]["b"], torch.zeros(6))
    live["m"] = torch.randn(4, 6)  # another shape
    assert equal_states(stager.stage(side())[0], side())
    fourth, _ = stager.stage(side(tied=False))  # the tie undone
    assert fourth["model"]["emb"] is not fourth["model"]["head"] and equal_states(fourth, side(tied=False))
    added = side()
    added["optimizer"][0]["exp_avg_sq"] = torch.ones(3)  # a key added
    assert equal_states(stager.stage(added)[0], added)
    sixth, _ = stager.stage(side(), share=(1, 2))  # another share: another layout (this rank's tensors, the rest withheld)
    assert sixth is not fourth and sum(isinstance(v, Withheld) for v in sixth["model"].values()) >= 1
    square = {"w": torch.randn(4, 4)}
    tied_as_is = {"model": {"a": square["w"], "b": square["w"]}, "optimizer": {}}
    assert stager.stage(tied_as_is)[0]["model"]["b"] is stager.stage(tied_as_is)[0]["model"]["a"]  # one buffer
    transposed = {"model": {"a": square["w"], "b": square["w"].t()}, "optimizer": {}}  # the same address and shape
    staged_t, _ = stager.stage(transposed)
    assert torch.equal(staged_t["model"]["b"], square["w"].t()) and torch.equal(staged_t["model"]["a"], square["w"])
    with_plain = side()
    with_plain["optimizer"][0]["step"] = 3  # a plain value among the tensors: walked, copied as it is
    fifth, _ = stager.stage(with_plain)
    assert fifth["optimizer"][0]["step"] == 3 and equal_states(fifth, with_plain)
    assert stager.stage(with_plain)[0] is not fifth  # (no plan is kept for a state that holds plain values)


class Opaque:
    """A class a weights_only load refuses (module-level, so torch.save can pickle it)."""


def test_the_check_after_writing_reads_state_pt_no_second_time_and_still_refuses_what_a_load_would(tmp_path, monkeypatch):
    from stabletrain.records.checkpoint import files

    reads: list[Path] = []
    real = files._checksum_of
    monkeypatch.setattr(files, "_checksum_of", lambda path, kind: reads.append(path) or real(path, kind))
    manager = CheckpointManager(tmp_path)  # (a background save's writer process runs this same write_staged)
    assert manager.save(tiny_state(1.0), 1).path.name == "step_000001"
    assert manager.save(tiny_state(2.0), 2).path.name == "step_000002"
    assert reads == []  # checksummed as written: verified without reading state.pt back
    manager.load()
    assert reads == [tmp_path / "step_000002" / "state.pt"]  # a load checks the file whole
    state = tiny_state(3.0)
    state["callbacks"] = {"mine": Opaque()}
    with pytest.raises(CheckpointError, match=r"failed verification right after writing: step_000003\.tmp-\d+: "
                                              r"state\.pt refused: it pickles the global test_checkpoint\.Opaque"):
        manager.save(state, 3)
    assert manager.latest_good().name == "step_000002"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LAST_GOOD", "step_000001", "step_000002"]


def test_a_plain_state_is_not_scanned_after_writing_and_anything_else_is(tmp_path, monkeypatch):
    from collections import OrderedDict

    from stabletrain.records.checkpoint import files

    scans: list[Path] = []
    real = files._check_archive
    monkeypatch.setattr(files, "_check_archive", lambda path, fail: scans.append(path) or real(path, fail))
    manager = CheckpointManager(tmp_path)
    manager.save(tiny_state(1.0), 1)
    assert scans == []  # tensors, numbers, strings and containers: weights_only admits them by design
    for odd in (Opaque(), b"bytes", 1j, torch.zeros(2).to_sparse(), torch.nn.Parameter(torch.zeros(1)),
                {("tuple", "key"): 1}):
        assert not files.only_plain({"x": [odd]})
    assert files.only_plain({"a": OrderedDict(w=torch.zeros(2)), "b": (1, 2.0, "s", None, True), 3: [torch.ones(1)]})
    state = tiny_state(2.0)
    state["callbacks"] = {"mine": Opaque()}
    with pytest.raises(CheckpointError, match=r"refused: it pickles the global test_checkpoint\.Opaque"):
        manager.save(state, 2)
    assert len(scans) == 1


def test_a_load_rank_0_verified_reads_state_pt_memory_mapped_without_hashing_it_again(tmp_path, monkeypatch):
    from stabletrain.records.checkpoint import files

    manager = CheckpointManager(tmp_path)
    manager.save(tiny_state(2.0), 2)
    reads: list[Path] = []
    real = files._checksum_of
    monkeypatch.setattr(files, "_checksum_of", lambda path, kind: reads.append(path) or real(path, kind))
    loaded = manager.load(tmp_path / "step_000002", verified=True)  # what ranks other than 0 do
    assert reads == [] and loaded.path == tmp_path / "step_000002"
    assert_same(loaded.state, tiny_state(2.0))
    state_pt = tmp_path / "step_000002" / "state.pt"
    state_pt.write_bytes(state_pt.read_bytes()[:-10])  # the size is still checked
    with pytest.raises(CheckpointError, match=r"state\.pt is \d+ bytes, meta\.json says \d+"):
        manager.load(tmp_path / "step_000002", verified=True)
