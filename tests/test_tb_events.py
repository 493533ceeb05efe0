"""The TensorBoard event files (stabletrain.records.tb_events), read with TensorBoard's own reader."""

import pytest

from stabletrain.records.tb_events import TensorBoardSink


def test_tensorboard_sink_writes_real_event_files(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = TensorBoardSink(tmp_path / "tb")
    sink.write({"step": 5, "loss": 1.5, "val_loss": 2.0, "top_grad_layers": [{"name": "w", "share": 1.0}]})
    sink.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(5, 1.5)]
    assert [e.value for e in acc.Scalars("val/val_loss")] == [2.0]


def test_tensorboard_event_file_crcs_pass_tensorboards_own_reader_and_a_flipped_byte_fails_it(tmp_path):
    # The sink frames records itself (a C CRC32C): TensorBoard's reader checks the header's and the data's masked
    # CRC32C of every record and stops at the first that fails, so a wrong CRC would lose events; flip one byte of
    # the last record's data to see that it checks.
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto.event_pb2 import Event

    sink = TensorBoardSink(tmp_path / "tb", purge_step=3)
    for step in (3, 4):
        sink.write({"step": step, "loss": 0.5 * step, "lr": 1e-3, "num_skipped": 0})
    path = sink.path
    # Read before close: each event is with the OS once written (a process killed after a log boundary, whose
    # checkpoint a background save commits later, must not lose the steps the checkpoint covers).
    events = [Event.FromString(r) for r in RawEventFileLoader(str(path)).Load()]
    sink.close()
    assert [e.file_version for e in events[:2]] == ["brain.Event:2"] * 2 and events[1].step == 3
    assert events[2].session_log.status == 1  # START at the purge step: TensorBoard drops what an earlier process wrote
    assert [(e.step, {v.tag: v.simple_value for v in e.summary.value}) for e in events[3:]] == [
        (3, {"train/loss": 1.5, "train/lr": pytest.approx(1e-3), "train/num_skipped": 0.0}),
        (4, {"train/loss": 2.0, "train/lr": pytest.approx(1e-3), "train/num_skipped": 0.0})]
    raw = bytearray(path.read_bytes())
    raw[-6] ^= 0x01  # inside the last record's data
    path.write_bytes(bytes(raw))
    # The loader reads a record that fails its CRC as the end of the file so far (a writer's partial record).
    assert len(list(RawEventFileLoader(str(path)).Load())) == len(events) - 1


def test_a_resumes_purge_holds_whatever_the_processs_file_count(tmp_path, monkeypatch):
    """A flaky CI failure: a process's event files were named by a bare counter, so its 10th file sorted before its 9th
    in the same second; TensorBoard reads files in name order, so a resume's purge came before the steps it drops."""
    import itertools

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from stabletrain.records import tb_events

    monkeypatch.setattr(tb_events, "_TB_FILES", itertools.count(9))
    monkeypatch.setattr(tb_events.time, "time", lambda: 1796500000.5)  # both in the same second
    first = TensorBoardSink(tmp_path / "tb")
    for step in (5, 10, 15):
        first.write({"step": step, "loss": 1.0})
    first.close()
    resumed = TensorBoardSink(tmp_path / "tb", purge_step=11)  # the 10th file: resumed from step 10
    resumed.write({"step": 15, "loss": 2.0})
    resumed.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(5, 1.0), (10, 1.0), (15, 2.0)]
