"""Containers: ``Sequential`` (named layers in order, with kernel fusion of adjacent pairs),
``LayerList``, ``LayerDict`` and ``ResidualBlock``."""
from collections import OrderedDict

from .conv import Conv2D
from .layer import Layer
from .basic_layers import Activation, Linear, ReLU
from .norm import BatchNorm


class Sequential(Layer):
    """Layers run in order. ``Sequential(a, b)`` names them ``"0"``, ``"1"``;
    ``Sequential(("fc1", a), ("act1", b))`` or an OrderedDict gives them names, which is what
    recompute checkpoints and exclusion lists refer to.

    With ``configure_fusion`` a Linear/Conv2D with bias followed by an activation runs as one
    fused bias+activation kernel, and a BatchNorm followed by ReLU as one batch-norm+ReLU kernel;
    names and parameters stay the same."""

    def __init__(self, *layers):
        super().__init__()
        if len(layers) == 1 and isinstance(layers[0], (dict, OrderedDict)):
            layers = tuple(layers[0].items())
        for index, item in enumerate(layers):
            if isinstance(item, tuple):
                if len(item) != 2 or not isinstance(item[0], str):
                    raise TypeError(f"Sequential entry {index} must be a Layer or a "
                                    f"(name, Layer) pair, not {item!r}")
                name, layer = item
            else:
                name, layer = str(index), item
            if not name or "." in name or name in self._children:
                raise ValueError(f"Sequential layer name {name!r} must be non-empty, contain no "
                                 "'.', and be unique")
            self.add_sublayer(name, layer)
        self._fuse_elewise_add_act = False
        self._fuse_bn_act = False
        self._steps = self._build_steps()

    def __len__(self):
        return len(self._children)

    def __getitem__(self, key):
        if isinstance(key, int):
            return list(self._children.values())[key]
        return self._children[key]

    def configure_fusion(self, fuse_elewise_add_act_ops=False, fuse_bn_act_ops=False):
        super().configure_fusion(fuse_elewise_add_act_ops, fuse_bn_act_ops)
        self._fuse_elewise_add_act = bool(fuse_elewise_add_act_ops)
        self._fuse_bn_act = bool(fuse_bn_act_ops)
        self._steps = self._build_steps()

    def _fused_activation(self, layer, following):
        """The activation ``layer`` absorbs from ``following``, or None."""
        if (self._fuse_elewise_add_act and isinstance(layer, (Linear, Conv2D))
                and layer.bias is not None and isinstance(following, Activation)):
            return following.act
        if self._fuse_bn_act and isinstance(layer, BatchNorm) and isinstance(following, ReLU):
            return "relu"
        return None

    def _build_steps(self):
        """``(layer, fused activation or None)`` steps in forward order."""
        layers = list(self._children.values())
        steps = []
        i = 0
        while i < len(layers):
            following = layers[i + 1] if i + 1 < len(layers) else None
            act = self._fused_activation(layers[i], following)
            steps.append((layers[i], act))
            i += 2 if act else 1
        return steps

    def fused_steps(self):
        """How many steps of this container run fused."""
        return sum(act is not None for _, act in self._steps)

    def steps(self):
        """The ``(layer, fused activation or None)`` steps ``forward`` runs, in order: each
        step runs ``layer.forward_act(x, act)`` when fused, else ``layer(x)``."""
        return list(self._steps)

    def forward(self, x):
        for layer, act in self._steps:
            x = layer.forward_act(x, act) if act else layer(x)
        return x


class LayerList(Layer):
    """Sublayers in a list, registered as ``"0"``, ``"1"``...: index, iterate, ``append``,
    ``extend``, ``insert``. It has no forward of its own."""

    def __init__(self, sublayers=None):
        super().__init__()
        for layer in sublayers or ():
            self.append(layer)

    def _layers(self):
        return list(self._children.values())

    def __len__(self):
        return len(self._children)

    def __iter__(self):
        return iter(self._layers())

    def __getitem__(self, index):
        layers = self._layers()
        if isinstance(index, slice):
            return LayerList(layers[index])
        return layers[index]

    def __setitem__(self, index, layer):
        names = list(self._children)
        setattr(self, names[index], layer)

    def append(self, layer):
        self.add_sublayer(str(len(self._children)), layer)
        return self

    def extend(self, layers):
        for layer in layers:
            self.append(layer)
        return self

    def insert(self, index, layer):
        layers = self._layers()
        layers.insert(index, layer)
        for name in list(self._children):
            delattr(self, name)
        self.extend(layers)


class LayerDict(Layer):
    """Sublayers by name, in insertion order, as a dict. It has no forward of its own."""

    def __init__(self, sublayers=None):
        super().__init__()
        for name, layer in (dict(sublayers) if sublayers else {}).items():
            self[name] = layer

    def __getitem__(self, name):
        return self._children[name]

    def __setitem__(self, name, layer):
        self.add_sublayer(name, layer)

    def __delitem__(self, name):
        delattr(self, name)

    def __len__(self):
        return len(self._children)

    def __iter__(self):
        return iter(self._children)

    def __contains__(self, name):
        return name in self._children

    def keys(self):
        return self._children.keys()

    def values(self):
        return self._children.values()

    def items(self):
        return self._children.items()


class ResidualBlock(Layer):
    """``relu(body(x) + shortcut(x))``; the shortcut is the identity when None.

    The shortcut is registered first so that the parameter order reversed (the flat-buffer
    layout) is the order backward completes gradients in: body from its end, then shortcut."""

    def __init__(self, body, shortcut=None):
        super().__init__()
        if shortcut is not None:
            self.shortcut = shortcut
        else:
            self.shortcut = None
        self.body = body
        self.relu = ReLU()

    def forward(self, x):
        skip = x if self.shortcut is None else self.shortcut(x)
        return self.relu(self.body(x) + skip)
