"""Messages between ranks of one host through shared memory, for the direct collectives.

Why: on this project's machine (4 gloo ranks on 2 cores) one gloo ``send``/``recv`` round
trip of 1 KB takes about 260 us and a 1 KB ``all_reduce`` about 7 ms, while a round trip of
one byte through a named pipe takes 13 us. gloo moves every message through a TCP socket
and its own event-loop thread, which must be scheduled before the waiting thread is woken.
A TP step at small sizes is all such latency. Here ranks on one host copy each message into
a ring in the receiver's shared memory and wake it through a pipe: one copy in, one copy out
(straight from and into strided views), one wake-up.

Layout: every rank owns one mailbox file (in ``/dev/shm``) holding one ring per same-host
peer, and one named pipe. A sender appends ``[header | payload]`` to its ring in the
receiver's mailbox, publishes the new head, and writes one byte to the receiver's pipe if the
receiver sleeps (non-blocking; a full pipe already holds wake-ups). A receiver copies messages
out in the order they were sent, publishes the new tail, and sleeps on its pipe when nothing
is there. Headers carry the size and a sequence number, so ranks that made different calls
get an error naming both, not garbage. A sleeping rank checks every second that the peers it
waits on still run: one that exited gives an error at once (as gloo notices a closed socket);
one that hangs, an error after the collective timeout. The files are unlinked once every rank
has opened them: nothing is left in ``/dev/shm`` however a process ends.

Messages between two ranks are delivered in the order they were posted, whatever their
process group: every rank makes its collectives in program order. Receives are completed
in order per sender; waiting on one also completes any earlier one from that sender and
any other whose message is already in (the destination views belong to the collective
until it is waited on). While a sender waits for room in a full ring it does the same, so
two ranks sending to each other cannot block one another.

Set ``SHARDPROP_SHM_TRANSPORT=0`` to keep gloo's point-to-point messages;
``SHARDPROP_SHM_SPINS`` how often a waiting rank yields its core before it sleeps (default 200);
``SHARDPROP_HOST_ID`` overrides the host identity (hostname and boot id) by which ranks find
their same-host peers; ``SHARDPROP_SHM_RING_MB`` sets the ring size per peer (default 4; messages up to half of it
go in one piece, larger ones in chunks, the receiver copying one out while the next goes in).

Example:
    >>> t = active()  # doctest: +SKIP
    >>> if t is not None and t.carries(1): t.send(1, x); t.flush()  # doctest: +SKIP
"""
from __future__ import annotations

import collections
import ctypes
import mmap
import os
import platform
import select
import socket
import tempfile
import threading
import time
import uuid
from typing import Dict, Optional

import torch
import torch.distributed as dist

from shardprop.mesh import groups as _groups
from shardprop.mesh.config import values as _settings

_HEADER = 64          # bytes before each payload (size, sequence number), keeps payloads 64-byte aligned
_COUNTERS = 256       # a ring's head, tail, "receiver asleep" and "sender wants room" flags, one cache line each
_WRAP = -1            # header size meaning "continue at the start of the ring"
MAX_RANKS_PER_HOST = 16
# Taking and releasing a lock is a locked instruction: a full memory fence on x86 (a store
# before it is visible to other cores before any load after it).
_FENCE = threading.Lock()
# Tries (each a sched_yield) before a waiting rank sleeps on its pipe: a yield hands the core to a
# runnable rank, a sleep costs a wake-up later. Measured on 4 ranks / 2 cores, interleaved TP steps
# (torchtitan plan): 200 tries against 0 took 15% off at dim 64 and 3% at dim 256.


# The ordering argument (payload stores before the head store, a locked instruction as a full
# fence) is x86's: elsewhere the rings stay off and gloo carries the messages.
_X86 = platform.machine().lower() in ("x86_64", "amd64")


def _enabled_by_env() -> bool:
    return _X86 and _settings.shm_transport and _settings.direct_collectives


def _ring_bytes() -> int:
    mb = _settings.shm_ring_mb
    return max(64 << 10, int(mb * (1 << 20)) // _HEADER * _HEADER)


def _round(n: int) -> int:
    return (n + _HEADER - 1) // _HEADER * _HEADER


def _host_id() -> str:
    # SHARDPROP_HOST_ID names the host outright: ranks that share a machine but should behave as
    # on separate hosts (the two-host test tier: two torchrun agents on one machine) get different
    # ones, and only ranks with equal ids share memory; between them gloo carries the messages.
    given = _settings.host_id
    if given:
        return f"id:{given}"
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


class _Ring:
    """One direction between two ranks: ``cap`` data bytes and their head/tail counters in a mailbox."""

    __slots__ = ("counters", "words", "data", "address", "cap", "pos", "seq")

    def __init__(self, buf: mmap.mmap, tensor: torch.Tensor, offset: int, cap: int) -> None:
        self.counters = memoryview(buf)[offset:offset + _COUNTERS].cast("q")  # [0] head [8] tail [16] asleep [24] room
        self.words = memoryview(buf)[offset + _COUNTERS:offset + _COUNTERS + cap].cast("q")
        self.data = tensor[offset + _COUNTERS:offset + _COUNTERS + cap]
        self.address = tensor.data_ptr() + offset + _COUNTERS  # for memmove of contiguous pieces
        self.cap = cap
        self.pos = 0   # this end's own counter (head for the sender, tail for the receiver)
        self.seq = 0   # messages this end sent / received on the ring


class _Recv:
    """A posted receive: done once its message was copied into ``view``.

    A message longer than a ring's chunk arrives in several chunks, copied into ``view`` (or,
    for a strided view, into a contiguous ``staged`` buffer first) as each comes in.
    """

    __slots__ = ("transport", "src", "view", "nbytes", "got", "staged", "done")

    def __init__(self, transport: "Transport", src: int, view: torch.Tensor) -> None:
        self.transport, self.src, self.view, self.done = transport, src, view, False
        self.nbytes, self.got = view.numel() * view.element_size(), 0
        self.staged = None
        if self.nbytes > transport.max_message and not view.is_contiguous():
            self.staged = torch.empty(view.shape, dtype=view.dtype)

    def wait(self, timeout=None) -> bool:
        if not self.done:
            self.transport.complete(self, timeout)
        return True


class Transport:
    """The shared-memory rings of this process with its same-host peers (global ranks).

    One thread at a time: every entry point holds the lock, released only while sleeping.
    """

    def __init__(self, rank: int, cap: int, mailbox: mmap.mmap, pipe: int, inbound: Dict[int, int],
                 peers: Dict[int, tuple], pids: Optional[Dict[int, int]] = None) -> None:
        self.rank, self.cap, self.max_message = rank, cap, cap // 2
        self._pids = dict(pids or {})  # peers whose process this one can see (same pid namespace)
        self._pipe = pipe  # the mappings stay alive through the rings' views of them
        mine = torch.frombuffer(mailbox, dtype=torch.uint8)
        self._in = {src: _Ring(mailbox, mine, off, cap) for src, off in inbound.items()}
        self._out: Dict[int, _Ring] = {}
        self._wake: Dict[int, int] = {}
        for dst, (buf, fd, off) in peers.items():
            self._out[dst] = _Ring(buf, torch.frombuffer(buf, dtype=torch.uint8), off, cap)
            self._wake[dst] = fd
        self._pending: Dict[int, collections.deque] = {src: collections.deque() for src in self._in}
        self._lock = threading.Lock()
        self._sent: list = []
        self.messages_sent = 0  # for tests and benchmarks: what went through the rings
        self._poll = select.poll()
        self._poll.register(pipe, select.POLLIN)

    def carries(self, peer: int) -> bool:
        """Whether messages to and from global rank ``peer`` go through shared memory (any size).

        Example:
            >>> active().carries(1)  # doctest: +SKIP
            True
        """
        return peer in self._out

    def covers(self, peers) -> bool:
        """Whether every one of ``peers`` (global ranks; this rank may be among them) is reached through rings.

        Every rank of a group gives the same answer: pairs are set up symmetrically.

        Example:
            >>> active().covers([0, 1, 2, 3])  # doctest: +SKIP
            True
        """
        return all(p == self.rank or p in self._out for p in peers)

    # -- sending ---------------------------------------------------------------------------
    def send(self, dst: int, view: torch.Tensor) -> None:
        """Copy ``view`` (any strides) into the ring to ``dst``; returns when copied (call :meth:`flush` after).

        A message longer than :attr:`max_message` goes in chunks, each waking ``dst`` if it
        sleeps: the receiver copies one out while the next goes in.

        Example:
            >>> t = active(); t.send(1, torch.ones(4)); t.flush()  # doctest: +SKIP
        """
        if not view.is_cpu:
            raise _host_only("send", view)
        nbytes = view.numel() * view.element_size()
        with self._lock:
            ring = self._out[dst]
            if nbytes <= self.max_message:
                off = self._reserve(ring, dst, nbytes, nbytes)
                _copy_in(ring, off + _HEADER, view, nbytes)
                ring.counters[0] = ring.pos  # published after the payload: x86 keeps stores in order
                ring.seq += 1
                self._sent.append(dst)
            else:
                src = view if view.is_contiguous() else view.contiguous()
                ptr = src.data_ptr()
                for o in range(0, nbytes, self.max_message):
                    chunk = min(self.max_message, nbytes - o)
                    off = self._reserve(ring, dst, chunk, nbytes)
                    ctypes.memmove(ring.address + off + _HEADER, ptr + o, chunk)
                    ring.counters[0] = ring.pos
                    self._wake_if_asleep([dst], 16)
                ring.seq += 1
            self.messages_sent += 1

    def _reserve(self, ring: _Ring, dst: int, chunk: int, total: int) -> int:
        """Room for one record of ``chunk`` payload bytes (waiting for it); writes its header, returns its offset."""
        need = _HEADER + _round(chunk)
        head, cap = ring.pos, ring.cap
        off = head % cap
        wrap = off + need > cap
        end = head + (cap - off if wrap else 0) + need
        if end - ring.counters[8] > cap:
            self._wait(lambda: end - ring.counters[8] <= cap, None, room=ring, room_peer=dst,
                       what=f"rank {dst} did not take the messages of rank {self.rank}")
        if wrap:
            ring.words[off // 8] = _WRAP
            off = 0
        ring.words[off // 8] = chunk
        ring.words[off // 8 + 1] = ring.seq
        ring.words[off // 8 + 2] = total
        ring.pos = end
        return off

    def flush(self) -> None:
        """Wake the receivers of the messages sent since the last flush that sleep waiting for them.

        Called once all messages of a collective are in their rings: a woken receiver may take
        this core at once, and then finds everything this rank sends it.

        Example:
            >>> active().flush()  # doctest: +SKIP
        """
        sent, self._sent = self._sent, []
        if sent:
            self._wake_if_asleep(set(sent) if len(sent) > 1 else sent, 16)

    def _wake_if_asleep(self, dsts, flag: int, rings=None) -> None:
        with _FENCE:  # the flag loads below must not pass the counter stores before them
            pass
        rings = self._out if rings is None else rings
        for dst in dsts:
            if rings[dst].counters[flag]:
                try:
                    os.write(self._wake[dst], b"\1")
                except BlockingIOError:  # the pipe is full of wake-ups already
                    pass

    # -- receiving -------------------------------------------------------------------------
    def recv(self, src: int, view: torch.Tensor) -> _Recv:
        """Post a receive of the next message from ``src`` into ``view``; ``wait()`` on the result.

        Example:
            >>> out = torch.empty(4); active().recv(0, out).wait()  # doctest: +SKIP
            True
        """
        if not view.is_cpu:
            raise _host_only("recv", view)
        handle = _Recv(self, src, view)
        with self._lock:
            self._pending[src].append(handle)
        return handle

    def complete(self, handle: _Recv, timeout=None) -> None:
        """Copy in messages (in order per sender) until ``handle``'s is in; sleep on the pipe meanwhile.

        Example:
            >>> t = active(); h = t.recv(0, torch.empty(4)); t.complete(h)  # doctest: +SKIP
        """
        with self._lock:
            self._wait(lambda: handle.done, timeout,
                       what=f"rank {self.rank} waited for a message from rank {handle.src}")

    def _wait(self, ready, timeout, room: Optional[_Ring] = None, what: str = "", room_peer: int = -1) -> None:
        """Take messages in until ``ready()``; between tries yield, then sleep until a peer wakes us.

        Before sleeping, this rank raises the "asleep" flag of every ring it expects a message
        on (and the "room wanted" flag of ``room``), fences, and looks once more: a peer stores
        its counter, fences and reads the flag, so one of the two sees the other's store. After
        each second asleep with nothing in, the peers waited on must still be running: one that
        exited gives an error at once, not after the collective timeout.
        """
        limit = _groups.collective_timeout().total_seconds() if timeout is None else _seconds(timeout)
        deadline = time.monotonic() + limit
        spins = 0
        while True:
            self._progress()
            if ready():
                return
            if spins < _settings.shm_spins:
                spins += 1
                os.sched_yield()
                continue
            if self._sent:  # receivers of what we sent must not sleep while we do
                self.flush()
            flags = [(self._in[src].counters, 16) for src, queue in self._pending.items() if queue]
            if room is not None:
                flags.append((room.counters, 24))
            for counters, i in flags:
                counters[i] = 1
            with _FENCE:
                pass
            self._progress()
            left, woke = deadline - time.monotonic(), True
            if not ready() and left > 0:
                self._lock.release()
                try:
                    woke = self._poll.poll(min(int(left * 1000) + 1, 1000))
                    if woke:
                        try:
                            os.read(self._pipe, 65536)  # drain the wake-ups; the rings say what arrived
                        except BlockingIOError:
                            pass
                finally:
                    self._lock.acquire()
                if not woke:
                    waited_on = [src for src, queue in self._pending.items() if queue] + [room_peer]
                    self._check_alive(waited_on, flags)
            for counters, i in flags:
                counters[i] = 0
            if time.monotonic() > deadline and not ready():
                raise _timed_out(f"{what} for {limit:g} s")

    def _check_alive(self, peers, flags) -> None:
        for peer in peers:
            pid = self._pids.get(peer)
            if pid is not None and not _running(pid):
                for counters, i in flags:
                    counters[i] = 0
                raise RuntimeError(f"rank {peer} (process {pid}) exited while rank {self.rank} waited on it "
                                   "through shared memory")

    def _progress(self) -> None:
        for src, queue in self._pending.items():
            while queue and self._take(src, self._in[src], queue[0]):
                if queue[0].done:
                    queue.popleft()

    def _take(self, src: int, ring: _Ring, handle: _Recv) -> bool:
        """Copy one record from ``ring`` into ``handle`` if there is one; whether one was taken."""
        tail = ring.pos
        if ring.counters[0] == tail:
            return False
        cap = ring.cap
        off = tail % cap
        if ring.words[off // 8] == _WRAP:
            tail += cap - off
            off = 0
        w = off // 8
        chunk, seq, total = ring.words[w], ring.words[w + 1], ring.words[w + 2]
        if seq != ring.seq or total != handle.nbytes or chunk > total - handle.got:
            raise RuntimeError(f"rank {src} sent message #{seq} of {total} bytes where rank {self.rank} expected "
                               f"#{ring.seq} of {handle.nbytes} bytes through shared memory: the ranks made "
                               "different calls")
        if chunk == total:
            _copy_out(ring, off + _HEADER, handle.view, chunk)
        else:
            into = handle.view if handle.staged is None else handle.staged
            ctypes.memmove(into.data_ptr() + handle.got, ring.address + off + _HEADER, chunk)
        handle.got += chunk
        ring.pos = tail + _HEADER + _round(chunk)
        ring.counters[8] = ring.pos
        if handle.got == total:
            ring.seq += 1
            handle.done = True
            if handle.staged is not None:
                handle.view.copy_(handle.staged)
        self._wake_if_asleep((src,), 24, self._in)  # its sender may sleep waiting for this room
        return True

    def close(self) -> None:
        """Release the mappings and the pipes (messages still in flight are lost).

        Example:
            >>> active().close()  # doctest: +SKIP
        """
        for fd in set(self._wake.values()) | {self._pipe}:
            try:
                os.close(fd)
            except OSError:
                pass
        self._in.clear(), self._out.clear(), self._wake.clear()


# Hot path: one message each way per peer and collective. A contiguous piece is one memmove
# (no tensor views made per message); a strided one goes through a typed view of the ring.
def _copy_in(ring: _Ring, off: int, view: torch.Tensor, nbytes: int) -> None:
    if view.is_contiguous():
        ctypes.memmove(ring.address + off, view.data_ptr(), nbytes)
    else:
        ring.data[off:off + nbytes].view(view.dtype).view(view.shape).copy_(view)


def _copy_out(ring: _Ring, off: int, view: torch.Tensor, nbytes: int) -> None:
    if view.is_contiguous():
        ctypes.memmove(view.data_ptr(), ring.address + off, nbytes)
    else:
        view.copy_(ring.data[off:off + nbytes].view(view.dtype).view(view.shape))


def _host_only(what: str, view: torch.Tensor) -> TypeError:
    """The error for device memory handed to the rings, which copy with the CPU (raised before any copy)."""
    return TypeError(f"shardprop shm transport: {what} of a {view.device} tensor; shared memory carries host "
                     "memory only (collectives.py stages device tensors through host memory before they get here)")


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists (signal 0 checks without sending; a zombie counts as exited)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _seconds(timeout) -> float:
    return timeout.total_seconds() if hasattr(timeout, "total_seconds") else float(timeout)


def _timed_out(what: str) -> RuntimeError:
    return RuntimeError(f"{what} through shared memory (SHARDPROP_SHM_TRANSPORT=0 sends through gloo instead)")


_state = {"world": None, "transport": None}


def active() -> Optional[Transport]:
    """The transport set up for the current default group, or None (off, other hosts, not set up).

    Example:
        >>> active() is None or active().rank == torch.distributed.get_rank()  # doctest: +SKIP
        True
    """
    t = _state["transport"]
    return t if t is not None and _state["world"] is dist.group.WORLD else None


def _directory() -> str:
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else tempfile.gettempdir()


def _create_mailbox(n_peers: int, cap: int) -> tuple:
    """This rank's mailbox file (one ring per peer, space reserved up front) and its pipe."""
    stem = os.path.join(_directory(), f"shardprop-{os.getpid()}-{uuid.uuid4().hex[:12]}")
    size = max(1, n_peers) * (_COUNTERS + cap)
    fd = os.open(stem + ".ring", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)  # fails now (ENOSPC), not with SIGBUS on first touch
        buf = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    os.mkfifo(stem + ".wake", 0o600)
    pipe = os.open(stem + ".wake", os.O_RDWR | os.O_NONBLOCK)
    return stem, buf, pipe


def _unlink(stem: Optional[str]) -> None:
    for suffix in (".ring", ".wake"):
        try:
            os.unlink(stem + suffix)
        except (OSError, TypeError):
            pass


def attach() -> Optional[Transport]:
    """Set up the rings with this host's other ranks: collective over the default group (call on every rank).

    Idempotent for one default group. Three small ``all_gather_object`` calls: hosts, mailbox
    names, whether each rank could open its peers'. A pair of ranks talks through shared
    memory only if both are on one host and both opened everything.

    Example:
        >>> attach()  # doctest: +SKIP
    """
    world = dist.group.WORLD
    if _state["world"] is world:
        return _state["transport"]
    old = _state["transport"]
    if old is not None:
        old.close()
    _state.update(world=world, transport=None)
    if dist.get_backend(world) != "gloo":  # the gathers below need a CPU-capable default group
        return None
    me, n = dist.get_rank(), dist.get_world_size()
    hosts = [None] * n
    dist.all_gather_object(hosts, (_host_id(), _enabled_by_env(), _ring_bytes()), group=world)
    local = [r for r in range(n) if hosts[r][:2] == hosts[me][:2] and hosts[r][1]]
    if not hosts[me][1] or len(local) < 2 or len(local) > MAX_RANKS_PER_HOST:
        local = []
    # One ring size for the host (ranks may have been given different ones): both ends of a ring
    # must agree on where it lies in the mailbox and where its chunks end.
    cap = min(hosts[r][2] for r in local) if local else hosts[me][2]
    peers = [r for r in local if r != me]
    stem, made = None, None
    try:
        if peers:
            stem, buf, pipe = _create_mailbox(len(peers), cap)
            made = (buf, pipe)
    except OSError:
        peers = []
    names = [None] * n
    dist.all_gather_object(names, (stem, peers, os.getpid()), group=world)
    opened, ok = {}, bool(peers)
    for dst in peers:
        dst_stem, dst_peers, _ = names[dst]
        if dst_stem is None or me not in dst_peers:
            ok = False
            break
        try:
            fd = os.open(dst_stem + ".ring", os.O_RDWR)
            try:
                buf = mmap.mmap(fd, os.fstat(fd).st_size)
            finally:
                os.close(fd)
            wake = os.open(dst_stem + ".wake", os.O_RDWR | os.O_NONBLOCK)
        except OSError:
            ok = False
            break
        opened[dst] = (buf, wake, dst_peers.index(me) * (_COUNTERS + cap))
    flags = [None] * n
    dist.all_gather_object(flags, ok, group=world)
    _unlink(stem)  # everyone has opened what it needs (or given up): leave nothing behind
    pairs = [r for r in peers if flags[r] and ok]
    if not pairs or made is None:
        for buf, wake, _ in opened.values():
            os.close(wake)
        if made is not None:
            os.close(made[1])
        return None
    inbound = {src: i * (_COUNTERS + cap) for i, src in enumerate(peers) if src in pairs}
    pids = {r: names[r][2] for r in pairs if _running(names[r][2])}  # a pid we cannot see is not checked
    transport = Transport(me, cap, made[0], made[1], inbound, {r: opened[r] for r in pairs}, pids)
    for r in opened.keys() - set(pairs):
        os.close(opened[r][1])
    _state["transport"] = transport
    return transport


def detach() -> None:
    """Drop this process's transport (the next :func:`attach` sets up a new one).

    Example:
        >>> detach()
    """
    t = _state["transport"]
    if t is not None:
        t.close()
    _state.update(world=None, transport=None)


__all__ = ["MAX_RANKS_PER_HOST", "Transport", "active", "attach", "detach"]
