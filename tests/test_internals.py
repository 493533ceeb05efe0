"""Every reach into a private internal (stabletrain.internals), against the installed torch and hosts.

An upgrade that removes or changes one fails here with the library's name and version, not in a user's run.
"""

from __future__ import annotations

import pytest
import torch

from stabletrain import internals
from stabletrain.internals import InternalMissing


def _fp16_setup(fused: bool):
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(3, 4)).float().pow(2).mean()
    scaler.scale(loss).backward()
    return model, opt, scaler


def test_the_scalers_device_scale_and_growth_tracker_round_trip_without_a_sync():
    _, _, scaler = _fp16_setup(False)
    assert internals.scaler_scale(scaler).item() == 16.0
    saved = internals.scaler_state(scaler)
    scaler.update(new_scale=2.0)
    assert internals.scaler_scale(scaler).item() == 2.0
    internals.set_scaler_state(scaler, saved, where=torch.tensor(False))
    assert internals.scaler_scale(scaler).item() == 2.0
    internals.set_scaler_state(scaler, saved)
    assert internals.scaler_scale(scaler).item() == 16.0 and scaler.state_dict()["_growth_tracker"] == 0
    assert internals.scaler_scale(torch.amp.GradScaler("cpu")) is None  # lazily made at the first scale()


def test_our_verdict_joins_the_scalers_inf_check_and_the_step_is_skipped():
    model, opt, scaler = _fp16_setup(False)
    assert (internals.scaler_found_inf(scaler, opt) == []
            and internals.join_scaler_found_inf(scaler, opt, torch.tensor(True)) is None)
    scaler.unscale_(opt)
    before = [p.detach().clone() for p in model.parameters()]
    own = internals.join_scaler_found_inf(scaler, opt, torch.tensor(True))
    assert own.item() is False  # the scaler itself found no inf
    scaler.step(opt)  # skipped: our verdict joined its found_inf
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


@pytest.mark.parametrize("skip", [True, False])
def test_a_fused_optimizer_skips_on_a_device_flag(skip):
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    assert internals.skips_on_device(opt) and not internals.skips_on_device(torch.optim.SGD(model.parameters(), lr=1.0))
    model(torch.randn(3, 4)).sum().backward()
    before = [p.detach().clone() for p in model.parameters()]
    with internals.fused_skip(opt, torch.tensor(skip)):
        assert internals.found_inf_set(opt) is not None
        opt.step()
    assert internals.found_inf_set(opt) is None  # cleared after the step
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters())) == skip
    assert opt.state_dict()["state"][0]["step"].item() == (0.0 if skip else 1.0)  # a skipped step is not counted


def test_a_missing_internal_is_one_clear_line_naming_the_library_and_its_version():
    class NotAScaler:
        pass

    with pytest.raises(InternalMissing, match=r"stabletrain needs GradScaler's device-side scale \(NotAScaler\._scale\), "
                                              r"which torch \d+\.\d+"):
        internals.scaler_scale(NotAScaler())


def test_find_caller_finds_the_object_whose_method_called_us():
    class Host:
        def run(self, fn):
            return fn()

    host = Host()
    assert host.run(lambda: internals.find_caller(lambda obj: obj is host)) is host
    assert internals.find_caller(lambda obj: False) is None


def test_the_hugging_face_trainer_is_found_from_its_callback():
    transformers = pytest.importorskip("transformers")
    from integration_models import gpt2

    from stabletrain.integrations.transformers import StableTrainCallback

    cb = StableTrainCallback(run_dir=None)
    args = transformers.TrainingArguments(output_dir="/tmp/unused-hf", use_cpu=True, report_to=[], max_steps=1)
    trainer = transformers.Trainer(model=gpt2(), args=args, callbacks=[cb])
    assert cb.trainer is trainer  # found at on_init_end, from the Trainer's own frames


def test_the_module_inside_a_torch_compile_wrapper_is_found_and_a_missing_one_is_one_line():
    inner = torch.nn.Linear(2, 2)
    wrapped = torch.compile(inner)  # nothing compiles until it is called
    assert internals.eager_module(wrapped) is inner
    assert internals.eager_module(inner) is inner
    assert [n for n, _ in internals.eager_module(wrapped).named_parameters()] == ["weight", "bias"]
    del wrapped._modules["_orig_mod"]  # a torch whose wrapper keeps the module elsewhere
    with pytest.raises(InternalMissing, match=r"the module inside a torch.compile wrapper \(OptimizedModule\._orig_mod\)"):
        internals.eager_module(wrapped)


def test_a_torch_save_without_the_zips_record_crcs_loads_as_torch_save_and_only_that_file_lacks_them(tmp_path):
    import zipfile

    state = {"w": torch.arange(6.0).view(2, 3), "n": 3, "names": ["a", "b"]}
    with open(tmp_path / "a.pt", "wb") as fh:
        internals.save_without_record_crcs(state, fh)
    loaded = torch.load(tmp_path / "a.pt", weights_only=True)
    assert torch.equal(loaded["w"], state["w"]) and loaded["n"] == 3 and loaded["names"] == ["a", "b"]
    assert {i.CRC for i in zipfile.ZipFile(tmp_path / "a.pt").infolist()} == {0}
    torch.save(state, tmp_path / "b.pt")  # the process-wide option is untouched
    assert zipfile.ZipFile(tmp_path / "b.pt").testzip() is None


# -- the replay tools: dispatch, autograd ------------------------------------------------------------------


def test_a_dispatch_mode_sees_each_aten_op_and_knows_which_write_into_an_input():
    seen = []

    class Recorder(internals.dispatch_mode_base()):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append((str(func), internals.op_writes_input(func)))
            return func(*args, **(kwargs or {}))

    t = torch.zeros(3)
    with Recorder():
        t.add_(1.0).mul(2.0)
    assert seen == [("aten.add_.Tensor", True), ("aten.mul.Tensor", False)]
    assert internals.op_writes_input(torch.ops.aten.add.out)  # out= writes too
    with pytest.raises(InternalMissing, match=r"an aten op's schema \(builtin_function_or_method\._schema\)"):
        internals.op_writes_input(print)


def test_inside_a_backward_the_node_is_named_and_a_queued_callback_runs_after_the_whole_graph():
    x = torch.ones(2, requires_grad=True)
    y = x * 3
    seen = []

    def hook(grad):
        node = internals.current_autograd_node()
        seen.append((internals.in_backward(), node.name(), x.grad))
        internals.queue_backward_callback(lambda: seen.append(("after the graph", x.grad.tolist())))

    y.register_hook(hook)
    y.sum().backward()
    assert seen == [(True, "MulBackward0", None), ("after the graph", [3.0, 3.0])]  # x.grad accumulated by then
    assert not internals.in_backward() and internals.current_autograd_node() is None


def test_a_tensors_version_counts_its_in_place_writes_and_views_share_it():
    t = torch.zeros(4)
    before = internals.tensor_version(t)
    t[:2].add_(1.0)  # through a view
    assert internals.tensor_version(t) == before + 1
    with torch.inference_mode():
        assert internals.tensor_version(torch.zeros(2)) is None  # an inference tensor keeps none
    with pytest.raises(InternalMissing, match=r"in-place write counter \(Tensor\._version\)"):
        internals.tensor_version(object())


# -- FSDP2 ------------------------------------------------------------------------------------------------


@pytest.fixture
def one_rank(tmp_path):
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed and no process group in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_fsdp2s_unsharded_gradients_between_syncs_are_found_and_a_torch_without_them_fails_loudly(one_rank,
                                                                                                   monkeypatch):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    model.load_state_dict(plain.state_dict())
    fully_shard(model[0])
    fully_shard(model)
    records = internals.fsdp_param_records(model)
    assert len(records) == 4 and internals.fsdp_pending_grads(records) == []  # nothing gathered, no grads yet
    model.set_requires_gradient_sync(False)  # an accumulation window's micro-batch: FSDP2 keeps the grads
    x = torch.randn(5, 4)
    model(x).pow(2).sum().backward()
    plain(x).pow(2).sum().backward()
    pending = internals.fsdp_pending_grads(records)
    assert all(p.grad is None for p in model.parameters())  # not in param.grad: only the records hold them
    assert sorted(tuple(g.shape) for g in pending) == sorted(tuple(p.shape) for p in plain.parameters())
    assert sorted(g.sum().item() for g in pending) == pytest.approx(sorted(p.grad.sum().item() for p in plain.parameters()))
    annotations = {k: v for k, v in FSDPParam.__annotations__.items() if k != "_unsharded_param"}
    monkeypatch.setattr(FSDPParam, "__annotations__", annotations)  # a torch that renamed it
    with pytest.raises(InternalMissing, match=r"the gradient FSDP2 accumulates between syncs "
                                              r"\(FSDPParam\._unsharded_param\), which torch \d.*leave it unscaled"):
        internals.fsdp_param_records(model)


def test_dcps_checkpoint_process_is_ended_by_its_own_termination_and_a_torch_without_it_is_one_line(one_rank, tmp_path,
                                                                                                  monkeypatch):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import _async_process_executor as executor
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    dcp.async_save({"w": torch.arange(4.0)}, storage_writer=dcp.FileSystemWriter(str(tmp_path / "dcp")),
                   async_checkpointer_type=AsyncCheckpointerType.PROCESS).result()
    process = executor._CHECKPOINT_PROCESS._save_process
    assert process.is_alive()
    internals.end_dcp_process()
    assert not process.is_alive() and process.exitcode == 0  # it left its serving loop on TERMINATE, no EOFError
    assert executor._CHECKPOINT_PROCESS is None
    internals.end_dcp_process()  # none left: nothing to do
    monkeypatch.delattr(executor, "_CHECKPOINT_PROCESS")
    with pytest.raises(InternalMissing, match=r"DCP's checkpoint process \(module._CHECKPOINT_PROCESS\), which torch \d"):
        internals.end_dcp_process()


# -- torch's pytree ---------------------------------------------------------------------------------------


def test_pytree_paths_are_plain_strings_and_the_tree_rebuilds():
    from collections import namedtuple

    Pair = namedtuple("Pair", "x y")
    tree = {"a": [torch.ones(1), (1, 2.5)], "n": Pair(torch.zeros(1), "s")}
    keyed, spec = internals.tree_flatten_with_keys(tree)
    assert [path for path, _ in keyed] == [("a", "0"), ("a", "1", "0"), ("a", "1", "1"), ("n", "x"), ("n", "y")]
    leaves, spec2 = internals.tree_flatten(tree)
    assert [leaf is k for leaf, (_, k) in zip(leaves, keyed)] == [True] * 5
    rebuilt = internals.tree_unflatten([leaf for _, leaf in keyed], spec)
    assert type(rebuilt["n"]) is Pair and rebuilt["a"][1] == (1, 2.5) and rebuilt["n"].y == "s"
    doubled = internals.tree_map(lambda v: v * 2 if isinstance(v, torch.Tensor) else v, tree)
    assert doubled["a"][0].item() == 2.0 and type(doubled["n"]) is Pair and doubled["a"][1] == (1, 2.5)


# -- torchrun's elastic agent -----------------------------------------------------------------------------


def test_torchruns_agent_is_subclassed_its_restarts_ended_and_a_launcher_built_otherwise_is_one_line(monkeypatch):
    import sys

    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous
    from torch.distributed.launcher import api

    cls = internals.restarting_agent(lambda agent, max_restarts, failures: None)
    assert issubclass(cls, LocalElasticAgent) and cls._monitor_workers is not LocalElasticAgent._monitor_workers
    spec = WorkerSpec(role="trainer", local_world_size=1, entrypoint=sys.executable, args=("-c", "pass"),
                      rdzv_handler=StaticTCPRendezvous("127.0.0.1", 0, 0, 1, "test", 10), max_restarts=3)
    agent = cls(spec, DefaultLogsSpecs())  # nothing starts until run()
    assert internals.restarts_left(agent) == 3
    internals.end_restarts(agent)
    assert internals.restarts_left(agent) == 0
    monkeypatch.setattr(api, "LocalElasticAgent", object)  # a launcher that no longer builds it from that name
    with pytest.raises(InternalMissing, match="a launcher that builds torch.distributed.launcher.api.LocalElasticAgent"):
        internals.restarting_agent(lambda *args: None)
    internals.use_elastic_agent(cls)
    assert api.LocalElasticAgent is cls  # (monkeypatch puts torch's back)


def test_a_parsers_actions_in_the_order_they_were_added():
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", dest="out_dir")
    parser.add_argument("names", nargs="*")
    assert [a.dest for a in internals.parser_actions(parser)] == ["help", "out_dir", "names"]


# -- the checkpoint's state.pt (stabletrain.records.checkpoint.checksummed) ---------------------------------


def test_a_checksummed_save_loads_with_torch_load_and_its_crc32_is_that_of_the_files_bytes(tmp_path, monkeypatch):
    import zipfile
    import zlib

    from stabletrain.records.checkpoint import checksummed

    state = {"model": {"w": torch.arange(12.0).view(3, 4)}, "step": 7, "rng": torch.ByteTensor([1, 2, 3])}
    for name in ("without", "with"):
        path = tmp_path / f"{name}.pt"
        with open(path, "wb") as fh:
            crc, num_bytes = checksummed.save_checksummed(state, fh)
        data = path.read_bytes()
        assert num_bytes == len(data) and crc == zlib.crc32(data)
        loaded = torch.load(path, weights_only=True)  # torch's own reader
        assert torch.equal(loaded["model"]["w"], state["model"]["w"]) and loaded["step"] == 7
        assert torch.equal(loaded["rng"], state["rng"])
        records = zipfile.ZipFile(path)
        assert ({i.CRC for i in records.infolist()} == {0}) == (name == "without")
        if name == "without":  # a torch without the writer that leaves them out: torch.save's own file, CRCs in
            monkeypatch.setattr(checksummed, "save_without_record_crcs",
                                lambda obj, fh: (_ for _ in ()).throw(InternalMissing("torch", "a test's writer")))
        else:
            assert records.testzip() is None
