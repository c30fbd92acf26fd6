"""The queue: who gets the next GPU slot, and how long a new idea waits for its first run.

The rule (controller/core/slots.py) is one pure function, `queue_order`, that the slot book
hands slots out by and `autolab get` numbers its QUEUE column by: priority first, then creation
time (never the name, unless two stamps are identical), one decision's pair runs at a time, and
a first run never waits behind more than FIRST_RUN_EVERY runs of the decision in progress.
"""

from __future__ import annotations

import json

import yaml

from controller.backends import Backend
from controller.core.reconcile import RunObservation
from controller.core.slots import FIRST_RUN_EVERY, SlotBook, Waiter, allocate_slots, queue_order
from test_operator import cluster  # noqa: F401  (the fixture: the API emulator and a lab dir)

T = "2024-05-01T12:00:00"  # one second: stamps inside it differ by microseconds only


def first(priority: int = 0, created: str = f"{T}Z") -> Waiter:
    return Waiter(priority, created, confirm=False)


def pair(priority: int = 0, created: str = f"{T}Z") -> Waiter:
    return Waiter(priority, created, confirm=True)


# --- the order ------------------------------------------------------------------------------------

def test_the_queue_goes_by_priority_then_creation_time_never_by_name():
    # Applied in one batch, c, a, b (one second: sub-second stamps keep their order).
    waiting = {"c": first(created=f"{T}.000100Z"), "a": first(created=f"{T}.000200Z"),
               "b": first(created=f"{T}.000300Z")}
    assert queue_order(waiting, None, 0) == (["c", "a", "b"], [])
    # A whole-second stamp (a cluster's creationTimestamp) is the instant it names: the start
    # of its second, before everything later in that second (as text, "Z" sorts after ".").
    waiting["z-old"] = first(created=f"{T}Z")
    assert queue_order(waiting, None, 0)[0] == ["z-old", "c", "a", "b"]
    # Priority first.
    waiting["urgent"] = first(priority=5, created="2024-05-01T13:00:00Z")
    assert queue_order(waiting, None, 0)[0] == ["urgent", "z-old", "c", "a", "b"]
    # The name decides only between identical stamps.
    same = {"b": first(), "a": first()}
    assert queue_order(same, None, 0)[0] == ["a", "b"]
    # A stamp that cannot be read goes last; "+00:00" is "Z".
    odd = {"x": first(created="yesterday"), "y": first(created=f"{T}.5+00:00"),
           "z": first(created=f"{T}.25Z")}
    assert queue_order(odd, None, 0)[0] == ["z", "y", "x"]


def test_free_slots_go_down_the_queue():
    queued = {"a": first(created=f"{T}.1Z"), "b": first(5, f"{T}.3Z"), "c": first(created=f"{T}Z"),
              "d": first(created=f"{T}.2Z")}
    assert allocate_slots(queued, busy={"1"}, slots=["0", "1", "2"]) == {"b": "0", "c": "2"}
    assert allocate_slots(queued, busy={"0", "1"}, slots=["0", "1"]) == {}


def test_a_higher_priority_run_goes_first_whatever_its_kind():
    # A decision in progress (priority 5) keeps the slot from first runs of lower priority,
    # however many runs it has had since the last first run.
    waiting = {"deep": pair(5), "new": first(0, f"{T}.5Z")}
    assert queue_order(waiting, "deep", 10)[0] == ["deep", "new"]
    # A first run of higher priority goes before the decision in progress.
    waiting = {"deep": pair(0), "urgent": first(5, f"{T}.5Z")}
    assert queue_order(waiting, "deep", 0)[0] == ["urgent", "deep"]
    # A higher priority's decision takes the turn between two runs of a lower one's.
    waiting = {"deep": pair(0), "urgent": pair(5, f"{T}.5Z")}
    assert queue_order(waiting, "deep", 0) == (["urgent"], ["deep"])


def test_confirmations_go_one_experiment_at_a_time_and_take_no_slot_from_first_runs():
    book = SlotBook(["0", "1", "2"])
    confirming = {"phase": "Confirming", "pairs": {"candidate": [0.99], "master": [1.0]}}
    book.observe("a", confirming, created=f"{T}.1Z")
    book.observe("b", confirming, created=f"{T}.2Z")
    assert book.grant("b", 0, f"{T}.2Z", confirm=True) is None, "a was first in line"
    assert book.grant("a", 0, f"{T}.1Z", confirm=True) == "0"
    book.observe("a", dict(confirming, job={"backend": "local", "name": "exp-a-1-p2",
                                            "slot": "0"}), created=f"{T}.1Z")
    assert book.grant("b", 0, f"{T}.2Z", confirm=True) is None, "a's confirmation is under way"
    assert book.grant("c", 0, f"{T}.3Z") is not None, "a first run still gets a free slot"
    book.observe("a", {"phase": "Succeeded", "outcome": "Rejected"})  # a's verdict is in
    assert book.grant("b", 0, f"{T}.2Z", confirm=True) is not None


def test_a_rebuilt_book_keeps_the_decision_in_progress_and_its_count():
    """The local loop fills a new book from the statuses at every pass: the decision whose
    turn it is keeps it while it waits between two runs, and the count goes on."""
    waiting = {"phase": "Confirming", "pairs": {"candidate": [0.99], "master": [1.0]}}
    book = SlotBook(["0"])
    book.observe("later", waiting, created=f"{T}.9Z")
    book.observe("early", waiting, created=f"{T}.1Z")
    book.confirming, book.since_first = "later", 1  # its turn, one run since a first run
    fresh = SlotBook(["0"])
    for name, created in (("later", f"{T}.9Z"), ("early", f"{T}.1Z")):
        fresh.observe(name, waiting, created=created)
    fresh.carry(book)
    assert (fresh.confirming, fresh.since_first) == ("later", 1)
    assert fresh.next_in_line() == "later", "the decision under way goes on, not the older one"
    book.confirming = "gone"  # a turn whose experiment is no longer active is not carried
    again = SlotBook(["0"])
    again.carry(book)
    assert again.confirming is None


def test_a_decision_a_promotion_voided_waits_for_the_decisions_turn_not_before_new_ideas():
    """After a promotion, every decision that was under way starts over on the new master
    (attempt 2: no pairs yet). Older than the specs applied since, as first runs they would all
    go before them; as confirmations they go one at a time, and a new spec's first run comes
    after at most FIRST_RUN_EVERY of their runs."""
    book = SlotBook(["0"])
    for i, name in enumerate(("voided-a", "voided-b", "voided-c")):
        book.observe(name, {"phase": "Confirming", "attempt": 2, "run": f"exp-{name}-2"},
                     created=f"{T}.00000{i}Z")
    book.observe("new-idea", {"phase": "Queued"}, created=f"{T}.9Z")
    assert book.queue() == ["voided-a", "new-idea", "voided-b", "voided-c"]
    book.confirming, book.since_first = "voided-a", FIRST_RUN_EVERY
    assert book.next_in_line() == "new-idea"
    # An experiment's first attempt, with no pairs, is a first run as before.
    book.observe("voided-a", {"phase": "Queued", "attempt": 1}, created=f"{T}.000000Z")
    assert book.queue()[0] == "voided-a"


# --- the bound ------------------------------------------------------------------------------------

class OneSlotLab:
    """A lab of one slot with the slot book alone: experiments whose decisions take a known
    number of runs, and a pass that gives the freed slot to whoever the book says."""

    def __init__(self, book_slots=("0",)):
        self.book = SlotBook(list(book_slots))
        self.runs_left: dict[str, int] = {}
        self.done: dict[str, int] = {}   # runs each experiment has had
        self.created: dict[str, str] = {}
        self.granted: list[tuple[str, bool]] = []  # (experiment, a run past its first)
        self.n = 0

    def apply(self, name: str, runs: int) -> None:
        self.n += 1
        self.created[name] = f"{T}.{self.n:06d}Z"
        self.runs_left[name], self.done[name] = runs, 0
        self.book.observe(name, {"phase": "Queued"}, 0, self.created[name])

    def status(self, name: str) -> dict:
        if self.runs_left[name] == 0:
            return {"phase": "Succeeded", "outcome": "Rejected"}
        if self.done[name] == 0:
            return {"phase": "Queued"}
        return {"phase": "Confirming", "pairs": {"candidate": [1.0] * self.done[name]}}

    def one_run(self) -> str | None:
        """The slot is free: everyone waiting asks (the decision in progress first, as the
        local loop asks runs in flight first); one gets it, runs, and its run ends."""
        expected = self.book.next_in_line()
        asking = sorted(self.book.waiting, key=lambda n: n != self.book.confirming)
        got = []
        for name in asking:
            confirm = self.done[name] > 0
            if self.book.grant(name, 0, self.created[name], confirm=confirm) is not None:
                got.append((name, confirm))
        assert len(got) <= 1, "one slot, one run"
        if not got:
            return None
        name, confirm = got[0]
        assert name == expected, "next_in_line agrees with grant"
        self.granted.append((name, confirm))
        self.book.observe(name, {**self.status(name), "job": {"backend": "local",
                                                              "name": f"r{len(self.granted)}",
                                                              "slot": "0"}},
                          0, self.created[name])
        self.done[name] += 1
        self.runs_left[name] -= 1
        self.book.observe(name, self.status(name), 0, self.created[name])
        return name


def test_a_new_first_run_waits_behind_at_most_FIRST_RUN_EVERY_runs_of_a_decision():
    """One slot, one long decision (depth-2: 13 runs), new specs applied while it goes on,
    one at a time: each is measured after at most FIRST_RUN_EVERY runs of the decision, not
    after the decision. The new specs' own decisions wait for depth-2's to end (one at a
    time), and then go on in creation order."""
    lab = OneSlotLab()
    lab.apply("depth-2", 13)
    arrivals = {1: "lr", 4: "wd", 7: "warmup", 10: "softcap"}  # after the lab's n-th run
    for step in range(1, 60):
        if lab.one_run() is None:
            break
        if step in arrivals:
            lab.apply(arrivals[step], 3)
    for arrived, name in arrivals.items():  # the runs it waited behind: lab.granted[arrived:]
        start = next(i for i, (n, _) in enumerate(lab.granted) if n == name)
        behind = [n for n, _ in lab.granted[arrived:start]]
        assert set(behind) <= {"depth-2"} and len(behind) <= FIRST_RUN_EVERY, \
            (name, lab.granted)
    order = [n for n, _ in lab.granted]
    assert order.index("softcap") < len(order) - order[::-1].index("depth-2") - 1, \
        "measured while depth-2's decision was still going on"
    assert all(lab.runs_left[n] == 0 for n in lab.runs_left), lab.granted
    later = [n for n, c in lab.granted if c and n != "depth-2"]
    assert [n for i, n in enumerate(later) if n not in later[:i]] == ["lr", "wd", "warmup",
                                                                       "softcap"]
    last_pair_of_depth2 = max(i for i, (n, c) in enumerate(lab.granted) if n == "depth-2")
    first_pair_of_others = min(i for i, (n, c) in enumerate(lab.granted)
                               if c and n != "depth-2")
    assert last_pair_of_depth2 < first_pair_of_others, "one decision at a time"


def test_a_batch_of_new_specs_gets_one_first_run_every_FIRST_RUN_EVERY_runs_of_the_decision():
    lab = OneSlotLab()
    lab.apply("depth-2", 13)
    lab.one_run()
    for name in ("c", "a", "b"):  # applied together, in this order
        lab.apply(name, 1)
    while lab.one_run() is not None:
        pass
    order = [n for n, _ in lab.granted]
    firsts = [order.index(n) for n in ("c", "a", "b")]
    assert firsts == sorted(firsts), "in the order they were applied"
    gaps = [b - a - 1 for a, b in zip([0] + firsts, firsts)]
    assert all(g <= FIRST_RUN_EVERY for g in gaps), order


# --- the local loop, end to end ------------------------------------------------------------

class StandIn(Backend):
    """The local backend's seam: a run ends at the lab's next look, with a val_bpb known in
    advance. The master measures 1.0 on every seed; `depth-2` is a hard decision (it beats the
    master by 0.010 and 0.001 at alternate places, so its pairs go to the cap); every other
    candidate is clearly worse (one run decides)."""

    name = "local"

    def __init__(self, master_source: str):
        self.master_source = master_source
        self.places: dict[int, int] = {}  # seed -> place, in the order they first ran
        self.runs: dict[str, list] = {}
        self.submitted: list[tuple[str, str]] = []  # (experiment, run)

    def submit(self, req) -> RunObservation:
        if req.run not in self.runs:
            place = self.places.setdefault(req.seed, len(self.places) + 1)
            if req.candidate_source == self.master_source:
                value = 1.0
            elif req.experiment == "depth-2":
                value = 1.0 - (0.010 if place % 2 else 0.001)
            else:
                value = 1.05
            self.runs[req.run] = [1, value]
            self.submitted.append((req.experiment, req.run))
        return self.observe(req.run)

    def observe(self, run: str) -> RunObservation:
        r = self.runs.get(run)
        if r is None:
            return RunObservation(run, "missing")
        if r[0] > 0:
            r[0] -= 1
            return RunObservation(run, "running")
        return RunObservation(run, "succeeded", result={"metrics": {"val_bpb": r[1]}})

    def cancel(self, run: str) -> RunObservation:
        return RunObservation(run, "cancelled")

    def cleanup(self, run: str) -> None:
        pass

    def leftovers(self, run: str) -> bool:
        return False


def test_one_slot_serves_specs_in_the_order_applied_and_new_ideas_between_a_decisions_runs(
        tmp_path, monkeypatch, capsys):
    """One GPU. depth-2 is a hard decision (its first run, then many pairs). While it is
    under way, `autolab apply -f c.yaml -f a.yaml -f b.yaml` applies three specs at once (in
    one second: their creation stamps differ by microseconds). They are measured in the order c, a, b, not
    in name order; each after at most FIRST_RUN_EVERY runs of depth-2 since the one before
    (the first since the apply, plus the run in flight), and all before depth-2's verdict.
    `autolab get` shows their places in the queue."""
    from controller.local import init_lab
    from controller.cli.main import main
    from labkit import spec_from_edit

    monkeypatch.setenv("AUTOLAB_GPUS", "0")
    monkeypatch.setenv("AUTOLAB_TRACKING", "0")
    with init_lab(tmp_path / "lab", profile="tiny", data="synthetic", budget=3, min_delta="auto",
                  max_pairs=8) as lab:
        lab.repo.set_master_metric(1.0, {1: 1.0})
        backend = StandIn(lab.repo.master_source())
        lab.backends["local"] = backend
        lab.apply_file(spec_from_edit(lab, "depth-2", "DEPTH = 8", "DEPTH = 2"), "test")
        for _ in range(10):  # until depth-2's first pair run is in flight
            lab.step()
            if len(backend.submitted) >= 2:
                break
        assert [e for e, _ in backend.submitted] == ["depth-2", "depth-2"]
        files = []
        for name, old, new in (("c", "MATRIX_LR = 0.02", "MATRIX_LR = 0.03"),
                               ("a", "WARMDOWN_RATIO = 0.5", "WARMDOWN_RATIO = 0.4"),
                               ("b", "WEIGHT_DECAY = 0.1", "WEIGHT_DECAY = 0.2")):
            path = tmp_path / f"{name}.yaml"
            path.write_text(yaml.safe_dump(spec_from_edit(lab, name, old, new)))
            files += ["-f", str(path)]
        applied = len(backend.submitted)
        assert main(["apply", "--lab", str(lab.root), *files]) == 0
        created = {n: json.loads(lab.paths.status_file(n).read_text())["metadata"]
                   ["creationTimestamp"] for n in "cab"}
        assert created["c"] < created["a"] < created["b"], created

        lab.step()  # checked and queued
        capsys.readouterr()
        assert main(["get", "--lab", str(lab.root), "-o", "json"]) == 0
        items = {i["metadata"]["name"]: i for i in json.loads(capsys.readouterr().out)["items"]}
        places = [items[n]["status"].get("queuePosition") for n in "cab"]
        assert all(places) and places == sorted(places), places
        assert main(["get", "--lab", str(lab.root)]) == 0
        table = capsys.readouterr().out.splitlines()
        start, end = table[0].index("QUEUE"), table[0].index("CAMPAIGN")
        shown = {line.split()[0]: line[start:end].strip() for line in table[1:]
                 if line[start:end].strip()}
        assert shown == {n: str(p) for n, p in zip("cab", places)}, table

        for _ in range(80):
            if lab.step().done:
                break
        who = [e for e, _ in backend.submitted]
        firsts = [who.index(n) for n in "cab"]
        assert [who[i] for i in sorted(firsts)] == ["c", "a", "b"], who
        for before, at in zip([applied] + firsts, firsts):
            assert who[before:at].count("depth-2") <= FIRST_RUN_EVERY + (before == applied), who
        depth2 = [i for i, e in enumerate(who) if e == "depth-2"]
        assert len(depth2) >= 9 and max(firsts) < depth2[-1], who  # a long decision
        st = json.loads(lab.paths.status_file("depth-2").read_text())["status"]
        assert st["phase"] == "Succeeded", st


# --- the operator ---------------------------------------------------------------------------------

async def test_the_operator_queues_by_creation_time_and_shows_the_queue_on_the_lab(cluster):
    """One slot in a cluster, held by a run: Experiments created a second apart meanwhile
    (creationTimestamp has whole seconds) wait in the order created, not by name; the Lab's
    status.queue lists them in that order, and the freed slot goes to the first of them."""
    import asyncio

    from test_operator import EXP, JOBS, LAB, LABS, experiment, operator, result, seed_lab

    c = cluster
    seed_lab(c.root, 1.0)
    await c.apply("labs", {**LAB, "spec": {**LAB["spec"], "capacity": {"gpuSlots": 1}}})
    async with operator(c):
        await c.apply("experiments", experiment("blocker", "WARMDOWN_RATIO = 0.5",
                                                "WARMDOWN_RATIO = 0.4"))
        await c.until("the blocker's Job", lambda: c.get(JOBS, "exp-blocker-1"))
        names = ["zz-first", "mm-second", "aa-third"]
        for name, new in zip(names, ("0.03", "0.04", "0.05")):
            await asyncio.sleep(1.05)  # another second
            await c.apply("experiments", experiment(name, "MATRIX_LR = 0.02",
                                                    f"MATRIX_LR = {new}"))
        await c.until("all three queued", lambda: all(c.phase(n) == "Queued" for n in names))
        await c.until("the queue on the Lab", lambda: (c.get(LABS, "default") or {}).get(
            "status", {}).get("queue") == names)
        pod = await c.start_pod("exp-blocker-1")
        await c.finish_pod(pod, result(1.05), exit_code=0)
        await c.until("the first one's Job", lambda: c.get(JOBS, "exp-zz-first-1"))
        await c.until("the rest of the queue", lambda: (c.get(LABS, "default") or {}).get(
            "status", {}).get("queue") == names[1:])
        assert c.get(JOBS, "exp-mm-second-1") is None and c.get(JOBS, "exp-aa-third-1") is None
        assert c.get(EXP, "aa-third")["status"]["phase"] == "Queued"
