"""Sharding stage 3: parameters that exist whole only while an operation uses them.

The optimizer updates ``shard_parameters`` (this rank's range of the parameter space), and the
model's flat values are freed. The parameters are grouped into units: those of one layer
(``gradient_allreduce.layer_of``, from the dotted name), cut where they are not contiguous in
the parameter space. When an operation is called with a parameter (``Function.apply`` asks the
parameter's keeper, this gatherer, bound by ``Parameter.bind_keeper``), its unit is all-gathered
from the shards (one ``allgatherv`` over the group) unless it is the unit gathered last, which
it then replaces: at most one unit is whole at a time besides what recorded operations keep for
their backward. In backward a unit is also released as soon as the backward of the last
operation that packed views of it is over, before its gradients are reduce-scattered.

A recorded operation usually saves the arrays of its parameters, or views of them, for its
backward. Those are packed right after its forward: each saved array that is a view of the
gathered unit is replaced by where in the unit it lies, so the unit's memory goes when the
next unit is gathered; the operation's backward gathers the unit again and rebuilds the views
(``_Packed.unpack``, called by the engine). A recomputed segment gathers again in the same way.
The values do not change between forward and backward, so an array that is not packed (held
somewhere else) still holds the right values, only its memory stays.

Whole parameters on request (``gather_all``, Paddle's ``get_all_parameters``): every unit is
gathered and stays whole, so the model's parameters read as the trained values (Paddle's tests
compare them after ``save_group_sharded_model``, which gathers them so). They stay whole until
the next update or ``assign`` makes them stale, and operations meanwhile use them without
gathering.

Every rank of a group must therefore run the same operations on the same parameters in the
same order, as with FSDP or ZeRO-3; a unit gathered on one rank only is a collective that the
others do not enter, reported by the comm layer's checks.

Units (``sharding_configs["unit_size_MB"]``): layers adjacent in the parameter space join
while the joined unit stays within that size, so a model of many small layers makes fewer,
larger gathers; a layer larger than it stays one unit. The default, 0, takes the model's
largest layer and an eighth of it as the size (``DEFAULT_UNIT_SLACK``): a whole unit then
takes little more memory than that layer alone does, and a small layer (a norm, a bias) beside
a large one costs no all-gather of its own, whose fixed cost (every rank of the group
entering it, on each of its steps) does not shrink with its bytes.

Prefetch (``sharding_configs["prefetch_depth"]``, the most units gathered ahead). The gatherer
records the units it gathers in one step, in order: forward's, then backward's (about the
reverse), and a recomputed segment's. The next step is expected to repeat it. Whenever a unit is
gathered, the all-gathers of the next ``prefetch_depth`` units of that sequence are started on
the communicator's background thread (``allgatherv_async``), so they run while the current
unit computes; a unit asked for that is in flight is waited for instead of gathered. The
sequence is the same on every rank (the ranks run the same operations), so every rank starts
the same collectives in the same order. A wrong guess costs time only: the units started ahead
of the one asked for are waited for and dropped, the one asked for is gathered now, and the
guess goes on from where it appears next in the sequence (or stops for the step). At most
``prefetch_depth + 1`` units are whole at once, besides what backward keeps (above). Before the
update, and before ``assign`` writes the shard, the units in flight are waited for and dropped:
their values would be stale. The first step has no record; it expects the units in the order of
the parameter space, then in reverse (the last unit, still whole, is not gathered again).
"""
import collections

import numpy as np

from fleetmpi.core import backend
from fleetmpi.comm import overlap_counts
from .gradient_allreduce import layer_of

# unit_size_MB 0: units up to the largest layer's size and this fraction of it more.
DEFAULT_UNIT_SLACK = 1 / 8


def _address(array):
    """The address of ``array``'s first element (NumPy or CuPy)."""
    data = array.data
    return data.ptr if hasattr(data, "ptr") else array.__array_interface__["data"][0]


def _owned_by(array, owner):
    """Whether ``array`` is ``owner`` or a view of it."""
    while array is not None:
        if array is owner:
            return True
        array = getattr(array, "base", None)
    return False


class _Unit:
    """Parameters of one layer that lie back to back in ``[start, stop)`` of the parameter
    space; ``counts``: how many of its elements each rank of the group holds; ``values``: the
    gathered array, while it is whole."""

    def __init__(self, index, parameters, start, stop, offsets):
        self.index = index
        self.parameters = parameters
        self.start = start
        self.stop = stop
        self.counts = overlap_counts(start, stop, offsets)
        self.values = None
        self.packed = 0


class _Packed:
    """The saved arrays of one recorded call that were views of the gathered ``unit``: for
    each, ``(attribute, position in a tuple or list or None, unit, element offset, shape, byte
    strides)``."""

    def __init__(self, gatherer, unit, entries):
        self.gatherer = gatherer
        self.unit = unit
        self.entries = entries
        unit.packed += 1

    def release(self, node):
        """``node``'s backward is over: its views of the unit are dropped, and the last call
        of the unit to finish its backward releases the unit."""
        for attribute, position, *_ in self.entries:
            _put(node, attribute, position, None)
        self.unit.packed -= 1
        if self.unit.packed == 0 and self.gatherer.current is self.unit:
            self.gatherer.forget()

    def unpack(self, node):
        """Put the views back on ``node``, gathering their units again where needed."""
        xp = backend.array_module()
        for attribute, position, unit, offset, shape, strides in self.entries:
            values = self.gatherer.gathered(unit)
            view = xp.lib.stride_tricks.as_strided(values[offset:], shape, strides)
            _put(node, attribute, position, view)


def _put(node, attribute, position, value):
    """Set ``node``'s ``attribute``, or item ``position`` of the tuple or list it holds."""
    if position is None:
        setattr(node, attribute, value)
        return
    held = getattr(node, attribute)
    items = list(held)
    items[position] = value
    setattr(node, attribute, type(held)(items))


def _elements(members):
    """How many elements of the parameter space ``members`` (``(start, parameter)`` pairs in
    order) span."""
    return members[-1][0] + members[-1][1].size - members[0][0]


def _joined(layers, most):
    """``layers`` (each a list of ``(start, parameter)``, in parameter-space order) joined
    where adjacent in the space while the joined elements stay within ``most``."""
    joined = []
    for members in layers:
        if joined:
            last = joined[-1]
            adjacent = members[0][0] == last[0][0] + _elements(last)
            if adjacent and _elements([last[0], members[-1]]) <= most:
                last.extend(members)
                continue
        joined.append(list(members))
    return joined


class ParameterGatherer:
    """The keeper of every parameter of a stage-3 optimizer (module docstring). ``units``:
    the units in parameter-space order; ``gathers``: how many all-gathers ran, of which
    ``prefetched`` were started ahead and ``dropped`` were not the unit asked for next;
    ``sequence``: the unit indices gathered so far in this step. ``prefetch_depth``: the most
    units gathered ahead (none in a group of one rank, where a gather is a copy);
    ``unit_bytes``: the most bytes of joined layers (0: the largest layer's and
    ``DEFAULT_UNIT_SLACK`` of it more)."""

    def __init__(self, optimizer, group, offsets, prefetch_depth=0, unit_bytes=0):
        self.optimizer = optimizer
        self.group = group
        self.offsets = offsets
        rank = 0 if group is None else group.rank
        self.shard = (offsets[rank], offsets[rank + 1])
        self.prefetch_depth = 0 if group is None else int(prefetch_depth)
        self.units = []
        self._unit_of = {}
        self._position = {}
        self.current = None
        self.gathers = self.prefetched = self.dropped = 0
        self.sequence = []
        self._in_flight = collections.deque()  # (unit, handle): _expected[_cursor:] in order
        self._cursor = 0
        placed = []
        for run, (low, _) in zip(optimizer.runs, optimizer.run_spans):
            placed += [(low + p.offset - run.start, p) for p in run.parameters]
        placed.sort(key=lambda item: item[0])
        by_layer = {}
        for start, p in placed:
            by_layer.setdefault(layer_of(p), []).append((start, p))
        layers = []
        for members in by_layer.values():
            run = [members[0]]
            for start, p in members[1:]:
                if start == run[-1][0] + run[-1][1].size:
                    run.append((start, p))
                else:
                    layers.append(run)
                    run = [(start, p)]
            layers.append(run)
        layers.sort(key=lambda members: members[0][0])
        itemsize = optimizer.runs[0].buffer.dtype.itemsize if optimizer.runs else 1
        largest = max(map(_elements, layers), default=0)
        most = (int(unit_bytes) // itemsize if unit_bytes
                else largest + int(largest * DEFAULT_UNIT_SLACK))
        for members in _joined(layers, most):
            self._add_unit(members)
        forward = [unit.index for unit in self.units]
        self._expected = forward + forward[-2::-1]
        for buffer in {id(run.buffer): run.buffer for run in optimizer.runs}.values():
            buffer.release_data()
        for _, p in placed:
            p.bind_keeper(self)

    def _add_unit(self, members):
        start = members[0][0]
        stop = members[-1][0] + members[-1][1].size
        unit = _Unit(len(self.units), [p for _, p in members], start, stop, self.offsets)
        self.units.append(unit)
        for position, p in members:
            self._unit_of[id(p)] = unit
            self._position[id(p)] = position

    # -- the keeper's protocol (Parameter.bind_keeper) ---------------------------------------
    def fetch(self, parameter):
        """``parameter``'s whole values, its unit gathered if it is not the current one."""
        self.gathered(self._unit_of[id(parameter)])
        return parameter.data

    def after_forward(self, node):
        """Replace what ``node`` saved of the current unit by where it lies in the unit;
        returns the ``_Packed`` record of it, or None when ``node`` saved none of it."""
        unit = self.current
        if unit is None:
            return None
        entries = []
        for attribute, value in list(vars(node).items()):
            if isinstance(value, (tuple, list)):
                items = list(value)
                packed = False
                for position, item in enumerate(items):
                    entry = self._pack(attribute, position, item, unit)
                    if entry is not None:
                        entries.append(entry)
                        items[position] = None
                        packed = True
                if packed:
                    setattr(node, attribute, type(value)(items))
            else:
                entry = self._pack(attribute, None, value, unit)
                if entry is not None:
                    entries.append(entry)
                    setattr(node, attribute, None)
        return _Packed(self, unit, entries) if entries else None

    def _pack(self, attribute, position, value, unit):
        if not hasattr(value, "strides") or not _owned_by(value, unit.values):
            return None
        itemsize = unit.values.dtype.itemsize
        offset = (_address(value) - _address(unit.values)) // itemsize
        return attribute, position, unit, offset, tuple(value.shape), tuple(value.strides)

    # -- gathering --------------------------------------------------------------------------
    def gathered(self, unit):
        """``unit``'s values, all-gathered (or taken from the prefetched ones) unless it is
        the current unit; the unit gathered before is released, and the next units expected
        are started ahead."""
        if unit.values is not None:
            return unit.values
        self.forget()
        values = self._take(unit)
        self.sequence.append(unit.index)
        self._bind(unit, values)
        self.current = unit
        self._prefetch()
        return values

    def _bind(self, unit, values):
        """Make ``values`` (the unit's gathered array) its parameters' values."""
        unit.values = values
        for p in unit.parameters:
            begin = self._position[id(p)] - unit.start
            p.bind_data(values[begin:begin + p.size].reshape(p.shape))

    def _piece(self, unit):
        start, stop = self.shard
        lo, hi = max(unit.start, start), min(unit.stop, stop)
        return self.optimizer.shard_parameters[max(0, lo - start):max(0, hi - start)]

    def _take(self, unit):
        """``unit``'s values: from its prefetch when it is in flight (those started before it
        are waited for and dropped), else gathered now, the guess moved to where ``unit``
        appears next in the expected sequence."""
        if any(ahead is unit for ahead, _ in self._in_flight):
            while True:
                ahead, handle = self._in_flight.popleft()
                values = handle.wait()
                self._cursor += 1
                if ahead is unit:
                    return values
                self.dropped += 1
        self.settle()
        following = self._expected[self._cursor:]
        self._cursor += following.index(unit.index) + 1 if unit.index in following \
            else len(following)
        self.gathers += 1
        if self.group is None:
            return self._piece(unit).copy()
        return self.group.allgatherv(self._piece(unit), unit.counts)

    def _prefetch(self):
        """Start the all-gathers of the next expected units, up to ``prefetch_depth``."""
        while len(self._in_flight) < self.prefetch_depth:
            position = self._cursor + len(self._in_flight)
            if position >= len(self._expected):
                return
            unit = self.units[self._expected[position]]
            self._in_flight.append((unit, self.group.allgatherv_async(self._piece(unit),
                                                                      unit.counts)))
            self.gathers += 1
            self.prefetched += 1

    def settle(self):
        """Wait for the units in flight and drop them (before the shard changes, or when the
        guess was wrong); the guess moves past them."""
        while self._in_flight:
            self._in_flight.popleft()[1].wait()
            self._cursor += 1
            self.dropped += 1

    def end_step(self):
        """After the update: the unit gathered last is stale, and what forward packed and
        backward did not reach (an output left unused) is not waited for. This step's
        sequence is what the next step expects."""
        self.settle()
        self.forget()
        for unit in self.units:
            unit.packed = 0
        if self.sequence:
            self._expected, self.sequence = self.sequence, []
        self._cursor = 0

    def forget(self):
        """Release the unit gathered last, and every unit ``gather_all`` left whole."""
        self.current = None
        for unit in self.units:
            if unit.values is not None:
                unit.values = None
                for p in unit.parameters:
                    p.release_data()

    def gather_all(self):
        """Gather every unit and leave it whole (module docstring); a collective over the
        group."""
        self.settle()
        self.forget()
        for unit in self.units:
            self.gathers += 1
            values = (self._piece(unit).copy() if self.group is None
                      else self.group.allgatherv(self._piece(unit), unit.counts))
            self._bind(unit, values)

    def assign(self, parameter, values):
        """Write the part of ``values`` (``parameter``'s whole values) in this rank's shard."""
        self.settle()
        begin = self._position[id(parameter)]
        start, stop = self.shard
        lo, hi = max(begin, start), min(begin + parameter.size, stop)
        if lo < hi:
            flat = values.reshape(-1)
            self.optimizer.shard_parameters[lo - start:hi - start] = flat[lo - begin:hi - begin]
        self.forget()
