"""``strategy.auto``: choose the strategy by measuring it inside the job.

On the first ``minimize`` call (the batch it gets is the one calibration trains on) auto

1. times the comm layer's allreduce algorithms (ring, native, hierarchical where the job spans
   more than one node, ring with float16 on the wire where allowed) at the model's gradient
   bucket sizes, which decides whether the hierarchical allreduce and fp16_allreduce are worth
   a training-step trial;
2. measures the activations one recorded forward holds for backward; above the memory budget
   every candidate trains with recompute (``recompute_checkpoints``);
3. times training steps of the model under the default settings and under each candidate:
   fusion sizes giving other bucket counts, fp16_allreduce, amp (GPU only), the hierarchical
   allreduce, and, where allowed, gradient_merge (when communication is a large share of the
   step), dgc, localsgd and adaptive_localsgd; then the best of each kind together;
   every measured candidate is timed again in rounds (each in turn, ``MAX_ROUNDS`` at most)
   while the bound leaves room, so a machine whose speed drifts slows all of them alike;
4. picks the fastest median among the candidates timed at least ``MIN_SAMPLES`` times, if
   it beats the default (timed as often) by more than ``MARGIN`` or half the spread of the
   default's own timings, whichever is larger (below that the difference is noise);
5. puts parameters, optimizer state and the random generator back as they were, so the
   training that follows is that of the chosen strategy set by hand.

Every timing is the slowest rank's; rank 0's choice is broadcast, so every rank applies the
same strategy. Only strategies ``auto_allow`` admits may change the arithmetic (see
``settings``). Every decision to measure more is checked against ``auto_seconds``.
"""
import copy
import math
import os
import statistics

from fleetmpi.core import backend
from fleetmpi import nn
from fleetmpi.comm import megabytes
from fleetmpi.config.distributed_strategy import DistributedStrategy
from fleetmpi.proto import distributed_strategy_pb2 as schema
from fleetmpi.strategies.applied import changed
from .measure import (Agreement, Clock, StepTimer, TrainingState, measure_forward,
                      time_allreduce)
from fleetmpi.strategies.compose import (build_strategies, check_combination, enabled_strategies,
                                         strategy_class)
from fleetmpi.strategies.gradient_allreduce import layer_of, plan_gradient_buckets

MARGIN = 0.03
MIN_SAMPLES = 2
COMM_SHARE = 0.25
MAX_ROUNDS = 5
MAX_COMM_SIZES = 4
MAX_FUSION_CANDIDATES = 3
MERGE_COMM_SHARE = 0.1
LOCALSGD_K_STEPS = 4


class Candidate:
    """One setting auto may choose: ``overlay`` (field: value) on top of the user's strategy.
    ``kind`` groups the alternatives of one decision; ``period`` is how many steps make one
    repeating unit (k_steps for gradient_merge, whose steps differ within a window). After
    calibration ``seconds`` is the per-step time (None: not measured, ``note`` says why).
    ``plan``: a fusion candidate's (megabytes, layers) per bucket."""

    def __init__(self, name, overlay, kind, period=1, plan=None):
        self.name = name
        self.overlay = overlay
        self.kind = kind
        self.period = period
        self.plan = plan
        self.seconds = None
        self.samples = []
        self.steps = 0
        self.note = ""
        self.hooks = None


class AutoReport:
    """What calibration measured and chose; ``text()`` is what rank 0 prints."""

    def __init__(self, bound):
        self.bound = bound
        self.seconds = 0.0
        self.comm = []
        self.comm_algorithms = []
        self.candidates = []
        self.skipped = []
        self.notes = []
        self.chosen = None
        self.margin = MARGIN

    def text(self):
        lines = [f"fleetmpi auto: calibrated in {self.seconds:.2f} s of its {self.bound:g} s "
                 "bound (auto_seconds / FLEETMPI_AUTO_SECONDS)"]
        if self.comm:
            lines.append("allreduce of the model's gradient buckets, ms (slowest rank):")
            lines.append("  " + f"{'bucket':>10}" + "".join(f"{a:>14}" for a in
                                                            self.comm_algorithms))
            for nbytes, times in self.comm:
                cells = "".join(f"{_ms(times.get(a)):>14}" for a in self.comm_algorithms)
                lines.append(f"  {_size(nbytes):>10}{cells}")
        lines.append("training step, ms per step (slowest rank; after an untimed step, median "
                     "of rounds that time every candidate in turn):")
        base = self.candidates[0].seconds
        width = max(len(c.name) for c in self.candidates)
        for c in self.candidates:
            if c.seconds is None:
                lines.append(f"  {c.name:<{width}}  not measured: {c.note}")
            else:
                lines.append(f"  {c.name:<{width}}  {c.seconds * 1e3:9.3f}  "
                             f"{base / c.seconds:5.2f}x  (median of {len(c.samples)}, "
                             f"{c.steps} steps)")
        grouped = {}
        for name, why in self.skipped:
            grouped.setdefault(why, []).append(name)
        lines += [f"not a candidate: {', '.join(names)}: {why}" for why, names in grouped.items()]
        lines += [f"note: {note}" for note in self.notes]
        chosen = self.chosen
        if len(self.candidates) == 1:
            lines.append(f"chosen: {chosen.name} (the only candidate)")
        elif chosen is self.candidates[0] and self.margin is None:
            lines.append(f"chosen: {chosen.name} (the bound left room to time it only once, "
                         "too few to tell a faster candidate from noise)")
        elif chosen is self.candidates[0]:
            lines.append(f"chosen: {chosen.name} (no candidate beat it by the margin of "
                         f"{self.margin:.0%}, the larger of {MARGIN:.0%} and half the spread "
                         "of the default's timings)")
        else:
            lines.append(f"chosen: {chosen.name} ({chosen.seconds * 1e3:.3f} ms per step "
                         f"against {base * 1e3:.3f} ms, {base / chosen.seconds:.2f}x)")
        return "\n".join(lines)


def _ms(seconds):
    return "-" if seconds is None else f"{seconds * 1e3:.3f}"


def _size(nbytes):
    return f"{nbytes / 2 ** 20:.2f} MB" if nbytes >= 2 ** 20 else f"{nbytes / 2 ** 10:.1f} KB"


def resolved(strategy, overlay):
    """A copy of ``strategy`` with ``auto`` off and ``overlay`` applied."""
    result = copy.deepcopy(strategy)
    result.auto = False
    for field, value in overlay.items():
        setattr(result, field, value)
    return result


def _user_fields(strategy):
    """The top-level fields the user set away from their defaults (``auto`` aside)."""
    default = DistributedStrategy()
    return {name for name in schema.DistributedStrategy.DESCRIPTOR.fields_by_name
            if name != "auto" and changed(strategy, default, name)}


def default_memory_budget(local_size):
    """Free device memory on a GPU; on CPU half the available host memory, shared by the ranks
    of the node."""
    if backend.on_gpu():
        return int(backend.array_module().cuda.runtime.memGetInfo()[0])
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        pass
    if available is None:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return available // 2 // max(local_size, 1)


def recompute_checkpoints(model, called):
    """recompute checkpoints for ``model``, or None when it has none worth recomputing.
    ``called``: the dotted names of the sublayers one forward called, each once, in call order.

    An ``nn.Sequential`` of at least three layers: every ~sqrt(n)-th top-level layer (never
    the last), cutting it into segments of ~sqrt(n) layers. Another Layer: its repeated
    blocks, the called members of its ``LayerList`` or ``LayerDict`` with the most of them
    (``"blocks.0"``, ``"blocks.1"``...), each recomputed as a whole; without one, its top-level
    sublayers with parameters that forward called, all but the last (backward starts with
    it), when that leaves at least two."""
    if isinstance(model, nn.Sequential):
        if len(model) < 3:
            return None
        names = [name for name, _ in model.named_children()]
        every = max(1, round(math.sqrt(len(names))))
        return names[every - 1:len(names) - 1:every]
    once = set(called)
    blocks = []
    for name, layer in model.named_sublayers():
        if isinstance(layer, (nn.LayerList, nn.LayerDict)):
            members = [f"{name}.{child}" for child, _ in layer.named_children()]
            members = [member for member in members if member in once]
            if len(members) > len(blocks):
                blocks = members
    if len(blocks) >= 2:
        return blocks
    top = [name for name, layer in model.named_children() if name in once and
           any(member.own_parameters() for _, member in layer.named_sublayers(
               include_self=True))]
    return top[:-1] if len(top) >= 3 else None


class Calibration:
    """One run of auto's calibration for a ``DistributedOptimizer`` being built (see the
    module docstring); ``run`` returns the chosen strategy and the report."""

    def __init__(self, strategy, knobs, optimizer, communicator, make_communicator,
                 local_size=1):
        self.strategy = strategy
        self.local_size = local_size
        self.knobs = knobs
        self.optimizer = optimizer
        self.communicator = communicator
        self.make_communicator = make_communicator
        self.agreement = Agreement(communicator)
        self.world = self.agreement.world
        self.report = AutoReport(knobs.seconds)
        self.user_fields = _user_fields(strategy)
        self._communicators = {}

    # -- candidates -------------------------------------------------------------------------
    def _admit(self, candidate):
        """Whether ``candidate`` can be tried; if not, why goes into the report."""
        touched = sorted(set(candidate.overlay) & self.user_fields)
        if touched:
            self.report.skipped.append((candidate.name, f"you set {', '.join(touched)}"))
            return False
        trial = resolved(self.strategy, candidate.overlay)
        try:
            names = enabled_strategies(trial)
            check_combination(names)
            for name in names:
                strategy_class(name).check(trial, self.optimizer)
        except ValueError as exc:
            self.report.skipped.append((candidate.name, str(exc)))
            return False
        return True

    def _allowed(self, name):
        if name in self.knobs.allow:
            return True
        self.report.skipped.append((name, "not listed in auto_allow / FLEETMPI_AUTO_ALLOW, "
                                          "which admits what changes the training's "
                                          "arithmetic"))
        return False

    def _buckets(self, size_mb, layers):
        """The buckets the data-parallel reduction plans at these fusion sizes (the last one
        bounded by the strategy's ``last_comm_group_size_MB``, as it will be)."""
        return plan_gradient_buckets(self.optimizer.runs, size_mb * 2 ** 20, layers,
                                     megabytes(self.strategy.last_comm_group_size_MB))

    def _fusion_candidates(self):
        """Fusion settings that cut the gradients into other numbers of buckets: by bytes
        (``fuse_grad_size_in_MB``) and by layers (``fuse_grad_size_in_TFLOPS``, the most layers
        per bucket), up to ``MAX_FUSION_CANDIDATES`` spread over the bucket counts found."""
        runs = self.optimizer.runs
        total = sum((run.stop - run.start) * run.buffer.dtype.itemsize for run in runs)
        layers = len({layer_of(p) for run in runs for p in run.parameters})
        base_mb = self.strategy.fuse_grad_size_in_MB
        base_layers = self.strategy.fuse_grad_size_in_TFLOPS
        options = [("fuse_grad_size_in_MB", mb, (mb, base_layers))
                   for mb in _powers_of_two(max(base_mb, total / 2 ** 20))]
        options += [("fuse_grad_size_in_TFLOPS", cap, (base_mb, cap))
                    for cap in _powers_of_two(layers)]
        by_count = {len(self._buckets(base_mb, base_layers)): None}
        for field, value, plan in options:
            by_count.setdefault(len(self._buckets(*plan)), (field, value, plan))
        found = sorted((count, option) for count, option in by_count.items() if option)
        if not found:
            self.report.skipped.append(
                ("fusion", f"the gradients ({_size(total)}, {layers} layers) make the same "
                           "buckets at every fusion size"))
        if len(found) > MAX_FUSION_CANDIDATES:
            last = len(found) - 1
            picks = {round(i * last / (MAX_FUSION_CANDIDATES - 1))
                     for i in range(MAX_FUSION_CANDIDATES)}
            found = [found[i] for i in sorted(picks)]
        candidates = []
        for count, (field, value, plan) in found:
            candidates.append(Candidate(f"{field}={value} ({count} buckets)",
                                        {"fuse_all_reduce_ops": True, field: value}, "fusion",
                                        plan=plan))
        return candidates

    def _bucket_sizes(self, fusion):
        sizes = set()
        plans = [(self.strategy.fuse_grad_size_in_MB, self.strategy.fuse_grad_size_in_TFLOPS)]
        for plan in plans + [c.plan for c in fusion]:
            sizes.update(int(bucket.grad.nbytes) for bucket in self._buckets(*plan))
        return sorted(sizes, reverse=True)[:MAX_COMM_SIZES]

    def _base_bucket_sizes(self):
        return [int(bucket.grad.nbytes) for bucket in
                self._buckets(self.strategy.fuse_grad_size_in_MB,
                           self.strategy.fuse_grad_size_in_TFLOPS)]

    # -- communication ----------------------------------------------------------------------
    def _time_communication(self, clock, fusion):
        """Time the allreduce algorithms at the bucket sizes, within ``COMM_SHARE`` of the
        bound; returns the seconds of one default-fusion step's buckets per algorithm (None:
        not measured)."""
        algorithms = [("ring", None), ("native", None)]
        if self.communicator.topology.num_nodes > 1:
            algorithms.append(("hierarchical", None))
        if "fp16_allreduce" in self.knobs.allow:
            algorithms.append(("ring", "fp16"))
        labels = [a if c is None else f"{a}+{c}" for a, c in algorithms]
        self.report.comm_algorithms = labels
        sizes = self._bucket_sizes(fusion)
        share = self.knobs.seconds * COMM_SHARE / (len(sizes) * len(algorithms))
        measured = {}
        stop = clock.elapsed() + self.knobs.seconds * COMM_SHARE
        for nbytes in sizes:
            times = {}
            for label, (algorithm, compression) in zip(labels, algorithms):
                if clock.elapsed() > stop:
                    break
                times[label] = time_allreduce(self.communicator, self.agreement, nbytes,
                                              algorithm, compression, share)
            self.report.comm.append((nbytes, times))
            measured[nbytes] = times
        per_step = {}
        for label in labels:
            parts = [measured.get(n, {}).get(label) for n in self._base_bucket_sizes()]
            per_step[label] = None if None in parts else sum(parts)
        return per_step

    def _comm_candidates(self, per_step):
        candidates = []
        plain = [per_step[a] for a in ("ring", "native") if per_step.get(a) is not None]
        best = min(plain) if plain else None
        if "hierarchical" in per_step:
            hier = per_step["hierarchical"]
            if hier is not None and best is not None and hier < best:
                candidates.append(Candidate("use_hierarchical_allreduce=True",
                                            {"use_hierarchical_allreduce": True},
                                            "hierarchical"))
            else:
                self.report.skipped.append(("use_hierarchical_allreduce",
                                            f"hierarchical {_ms(hier)} ms is not faster than "
                                            f"{_ms(best)} ms at the model's buckets"))
        else:
            self.report.skipped.append(("use_hierarchical_allreduce",
                                        "the job runs on one node"))
        if self._allowed("fp16_allreduce"):
            fp16 = per_step.get("ring+fp16")
            if fp16 is not None and best is not None and fp16 < best:
                candidates.append(Candidate("fp16_allreduce=True", {"fp16_allreduce": True},
                                            "fp16_allreduce"))
            else:
                self.report.skipped.append(("fp16_allreduce",
                                            f"ring+fp16 {_ms(fp16)} ms is not faster than "
                                            f"{_ms(best)} ms at the model's buckets"))
        return candidates

    def _convergence_candidates(self, comm_seconds, base_seconds):
        candidates = []
        share = comm_seconds / base_seconds if comm_seconds is not None else None
        if self.world == 1:
            for name in ("gradient_merge", "dgc", "localsgd", "adaptive_localsgd"):
                if name in self.knobs.allow:
                    self.report.skipped.append((name, "one process: no communication to save"))
            return candidates
        if self._allowed("gradient_merge"):
            if share is not None and share >= MERGE_COMM_SHARE:
                for k in (2, 4):
                    candidates.append(Candidate(
                        f"gradient_merge k_steps={k}",
                        {"gradient_merge": True,
                         "gradient_merge_configs": {"k_steps": k, "avg": True}},
                        "gradient_merge", period=k))
            elif share is None:
                self.report.skipped.append(("gradient_merge", "the collectives were not timed "
                                                              "within the bound"))
            else:
                self.report.skipped.append(("gradient_merge",
                                            f"communication is {share:.0%} of the step, "
                                            f"under {MERGE_COMM_SHARE:.0%}: the batch keeps "
                                            "the device busy"))
        if self._allowed("dgc"):
            candidates.append(Candidate("dgc=True", {"dgc": True}, "averaging"))
        if self._allowed("localsgd"):
            candidates.append(Candidate(
                f"localsgd k_steps={LOCALSGD_K_STEPS}",
                {"localsgd": True, "localsgd_configs": {"k_steps": LOCALSGD_K_STEPS}},
                "averaging", period=LOCALSGD_K_STEPS))
        if self._allowed("adaptive_localsgd"):
            candidates.append(Candidate("adaptive_localsgd=True", {"adaptive_localsgd": True},
                                        "averaging"))
        return candidates

    def _amp_candidates(self):
        if not self._allowed("amp"):
            return []
        if not backend.on_gpu():
            self.report.skipped.append(("amp", "float16 compute pays only on a GPU; on CPU it "
                                               "is emulated and slower"))
            return []
        return [Candidate("amp=True", {"amp": True}, "amp")]

    # -- memory -----------------------------------------------------------------------------
    def _recompute_overlay(self, model, loss_fn, x, y):
        """The recompute overlay every candidate needs when one forward's activations exceed
        the budget, else {}."""
        held, called = measure_forward(model, loss_fn, x, y, self.optimizer)
        held = int(self.agreement.max([held])[0])
        budget = self.knobs.memory_bytes
        if budget is None:
            budget = int(self.agreement.max([default_memory_budget(self.local_size)])[0])
        if held <= budget:
            self.report.notes.append(f"activations {_size(held)} fit the memory budget "
                                     f"{_size(budget)}: no recompute")
            return {}
        if self.strategy.recompute:
            return {}
        checkpoints = recompute_checkpoints(model, called)
        if checkpoints is None:
            self.report.notes.append(f"activations {_size(held)} exceed the memory budget "
                                     f"{_size(budget)}, but the {type(model).__name__} has no "
                                     "sublayers to recompute: an nn.Sequential needs at least "
                                     "three layers, another Layer blocks in a LayerList or "
                                     "LayerDict or at least three top-level sublayers with "
                                     "parameters that its forward calls once")
            return {}
        self.report.notes.append(f"activations {_size(held)} exceed the memory budget "
                                 f"{_size(budget)}: every candidate recomputes "
                                 f"checkpoints {checkpoints}")
        return {"recompute": True, "recompute_configs": {"checkpoints": checkpoints}}

    # -- training steps ---------------------------------------------------------------------
    def communicator_for(self, strategy):
        """The communicator ``strategy``'s allreduce fields need: the job's, or one built for
        a trial (kept until ``release``)."""
        if self.communicator is None:
            return None
        key = (strategy.use_hierarchical_allreduce, strategy.hierarchical_allreduce_inter_nranks,
               strategy.nccl_comm_num)
        base = (self.strategy.use_hierarchical_allreduce,
                self.strategy.hierarchical_allreduce_inter_nranks, self.strategy.nccl_comm_num)
        if key == base:
            return self.communicator
        if key not in self._communicators:
            self._communicators[key] = self.make_communicator(strategy)
        return self._communicators[key]

    def _sample(self, candidate, timer, state):
        """One more timing of ``candidate``: from the saved training state, one untimed step
        then one window of ``period`` timed steps; the slowest rank's seconds per step."""
        state.restore()
        if candidate.hooks is None:
            trial = resolved(self.strategy, candidate.overlay)
            candidate.hooks = build_strategies(trial, self.optimizer, self.communicator_for(trial))
        timer.run(candidate.hooks, candidate.steps, 1)
        seconds = timer.run(candidate.hooks, candidate.steps + 1, candidate.period)
        candidate.steps += 1 + candidate.period
        candidate.samples.append(float(self.agreement.max([seconds / candidate.period])[0]))
        candidate.seconds = statistics.median(candidate.samples)

    def _first_samples(self, candidates, timer, state, clock):
        """A first timing of each of ``candidates`` in turn while the bound leaves room for
        it; the rest are marked as not measured."""
        for candidate in candidates:
            cost = self.report.candidates[0].seconds * (1 + candidate.period)
            if clock.left() < cost:
                candidate.note = f"the {self.knobs.seconds:g} s bound was reached"
                continue
            self._sample(candidate, timer, state)

    def _more_rounds(self, timer, state, clock):
        """Further timings of every measured candidate, a round at a time, each round in the
        same order, so a machine whose speed drifts slows every candidate alike."""
        measured = [c for c in self.report.candidates if c.seconds is not None]
        cost = sum(c.seconds * (1 + c.period) for c in measured)
        rounds = 1
        while rounds < MAX_ROUNDS and clock.left() >= cost:
            for candidate in measured:
                self._sample(candidate, timer, state)
            rounds += 1

    def _margin(self):
        """How much faster than the default a candidate must be: ``MARGIN``, or half the
        spread of the default's timings relative to their median when that is larger."""
        samples = self.report.candidates[0].samples
        spread = (max(samples) - min(samples)) / statistics.median(samples) / 2
        return max(MARGIN, spread)

    def _combined(self, measured, base_seconds):
        best = {}
        for c in measured:
            if c.seconds is not None and c.seconds < base_seconds * (1 - self._margin()):
                if c.kind not in best or c.seconds < best[c.kind].seconds:
                    best[c.kind] = c
        if len(best) < 2:
            return None
        overlay = {}
        for c in best.values():
            overlay.update(c.overlay)
        return Candidate(" + ".join(c.name for c in best.values()), overlay, "combined",
                         period=max(c.period for c in best.values()))

    def run(self, model, loss_fn, x, y):
        """Calibrate on the batch ``x, y``; returns ``(strategy to apply, AutoReport)`` with
        the model and optimizer as they were before."""
        clock = Clock(self.knobs.seconds, self.agreement)
        state = TrainingState(model, self.optimizer)
        timer = StepTimer(model, loss_fn, x, y, self.optimizer)
        recompute = self._recompute_overlay(model, loss_fn, x, y)
        state.restore()
        fusion = self._fusion_candidates() if self.world > 1 else []
        per_step = self._time_communication(clock, fusion) if self.world > 1 else {}
        if self.world == 1:
            self.report.skipped.append(("fusion, fp16_allreduce, use_hierarchical_allreduce",
                                        "one process: no gradients to exchange"))
        base = Candidate("default + recompute" if recompute else "default", dict(recompute),
                         "default")
        self.report.candidates.append(base)
        self._sample(base, timer, state)
        singles = [c for c in fusion if self._admit(c)]
        singles += [c for c in self._comm_candidates(per_step) if self._admit(c)] \
            if self.world > 1 else []
        singles += [c for c in self._amp_candidates() if self._admit(c)]
        plain = [v for k, v in per_step.items() if k in ("ring", "native") and v is not None]
        singles += [c for c in self._convergence_candidates(min(plain) if plain else None,
                                                            base.seconds) if self._admit(c)]
        for c in singles:
            c.overlay = {**recompute, **c.overlay}
        self.report.candidates += singles
        self._first_samples(singles, timer, state, clock)
        combined = self._combined(singles, base.seconds)
        if combined is not None and self._admit(combined):
            self.report.candidates.append(combined)
            self._first_samples([combined], timer, state, clock)
        self._more_rounds(timer, state, clock)
        chosen = base
        timed_twice = [c for c in self.report.candidates if len(c.samples) >= MIN_SAMPLES]
        if base in timed_twice:
            self.report.margin = self._margin()
            fastest = min(timed_twice, key=lambda c: c.seconds)
            if fastest.seconds < base.seconds * (1 - self.report.margin):
                chosen = fastest
        else:
            self.report.margin = None
        index = self.agreement.from_rank0(self.report.candidates.index(chosen))
        self.report.chosen = self.report.candidates[index]
        state.restore()
        for candidate in self.report.candidates:
            candidate.hooks = None
        self.report.seconds = clock.elapsed()
        return resolved(self.strategy, self.report.chosen.overlay), self.report

    def release(self, keep):
        """Free the communicators calibration built, except ``keep``."""
        for communicator in self._communicators.values():
            if communicator is not keep:
                communicator.free()
        self._communicators.clear()


def _powers_of_two(limit):
    """1, 2, 4, ... up to the first at least ``limit``."""
    powers = [1]
    while powers[-1] < limit:
        powers.append(powers[-1] * 2)
    return powers
