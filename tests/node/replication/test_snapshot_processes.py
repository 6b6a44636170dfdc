"""A slave that joins after its master cleaned the start of message_log resyncs from a snapshot of
the master (real processes): it restarts itself to install the snapshot, replicates on from the
snapshot's offset, and once promoted holds every message, pending or delivered as on the master."""
from __future__ import annotations


from delayserver.client import AsyncProducer, Message
from delayserver.message import MessageState
from delayserver.storage.message_log import SUFFIX

from tests.procs import ServerProcess, wait_for

HOUR = 3_600_000


def message_log_range(data_dir) -> tuple[int, int]:
    """(start, end) of a node's message_log, from its segment files."""
    segments = []
    for path in (data_dir / "message_log").glob("*" + SUFFIX):
        try:
            segments.append((int(path.name[: -len(SUFFIX)]), path.stat().st_size))
        except FileNotFoundError:  # the node's cleaner removed it since the listing
            continue
    segments.sort()
    return segments[0][0], segments[-1][0] + segments[-1][1]


async def test_a_slave_behind_retention_resyncs_from_a_snapshot(tmp_path):
    config = tmp_path / "master.toml"
    config.write_text('message_log_segment_bytes = 4096\nretention_ms = 0\ncleaner_interval_ms = "100ms"\n'
                      'checkpoint_interval_ms = 20\n')
    master = ServerProcess(tmp_path / "m", ["--config", str(config)]).start()
    slave = promoted = None
    try:
        async with AsyncProducer(master.address) as prod:
            delivered = await prod.send_many([Message("snap.q", b"now", delay=0) for _ in range(20)])
            pending = []
            for _ in range(30):  # a segment rolls between requests
                pending += await prod.send_many([Message("snap.q", b"p" * 64, delay=HOUR) for _ in range(10)])
            assert wait_for(lambda: message_log_range(master.data_dir)[0] > 0, 60), "the cleaner did not run"
            slave = ServerProcess(tmp_path / "s", ["--replicate-from", master.address]).start()
            assert wait_for(lambda: "installed the master's snapshot" in slave.log_text(), 60), slave.log_text()[-3000:]
            later = await prod.send_many([Message("snap.q", b"later", delay=HOUR) for _ in range(10)])
        end = message_log_range(master.data_dir)[1]
        assert wait_for(lambda: message_log_range(slave.data_dir)[1] == end, 60)
        assert message_log_range(slave.data_dir)[0] > 0  # it began where the snapshot did
        slave.terminate()
        master.terminate()
        promoted = ServerProcess(tmp_path / "s").start()
        async with AsyncProducer(promoted.address) as prod:
            for handle in pending + later:
                assert (await prod.status(handle)).state == MessageState.PENDING, handle
            for handle in delivered:
                assert (await prod.status(handle)).state == MessageState.DELIVERED, handle
    finally:
        for process in (master, slave, promoted):
            if process is not None:
                process.kill()
    assert "snapshot" in (tmp_path / "s.server.log").read_text()


