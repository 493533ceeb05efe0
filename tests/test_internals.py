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
    assert internals.scaler_found_inf(scaler, opt) == [] and internals.join_scaler_found_inf(scaler, opt, torch.tensor(True)) is None
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
