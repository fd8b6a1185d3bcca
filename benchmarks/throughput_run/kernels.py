"""How many kernels one training step launches on a GPU, without CUPTI: the step is captured
into a CUDA graph (CuPy's stream capture, which records the launches of CuPy, cuBLAS and cuDNN
on the capturing stream without running them), and the graph's kernel nodes are counted
through the driver API (``cuGraphGetNodes``, ``cuGraphNodeGetType``, child graphs followed).

A step that waits on the device inside (a read of a device value, as amp's overflow check
makes) cannot be captured; the count is then None with the reason.
"""
import ctypes

KERNEL_NODE, CHILD_GRAPH_NODE = 0, 4  # CUgraphNodeType


def _driver():
    driver = ctypes.CDLL("libcuda.so.1")
    driver.cuGraphGetNodes.argtypes = [ctypes.c_void_p, ctypes.c_void_p,
                                       ctypes.POINTER(ctypes.c_size_t)]
    driver.cuGraphNodeGetType.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
    driver.cuGraphChildGraphNodeGetGraph.argtypes = [ctypes.c_void_p,
                                                     ctypes.POINTER(ctypes.c_void_p)]
    return driver


def _checked(status, call):
    if status != 0:
        raise RuntimeError(f"{call} returned CUresult {status}")


def graph_kernels(driver, graph):
    """The kernel nodes of the CUDA graph ``graph`` (a ``CUgraph``), its child graphs'
    included."""
    count = ctypes.c_size_t(0)
    _checked(driver.cuGraphGetNodes(graph, None, ctypes.byref(count)), "cuGraphGetNodes")
    nodes = (ctypes.c_void_p * count.value)()
    _checked(driver.cuGraphGetNodes(graph, nodes, ctypes.byref(count)), "cuGraphGetNodes")
    kernels = 0
    for node in nodes[:count.value]:
        kind = ctypes.c_int(-1)
        _checked(driver.cuGraphNodeGetType(node, ctypes.byref(kind)), "cuGraphNodeGetType")
        if kind.value == KERNEL_NODE:
            kernels += 1
        elif kind.value == CHILD_GRAPH_NODE:
            child = ctypes.c_void_p()
            _checked(driver.cuGraphChildGraphNodeGetGraph(node, ctypes.byref(child)),
                     "cuGraphChildGraphNodeGetGraph")
            kernels += graph_kernels(driver, child)
    return kernels


def _failure(exc):
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:300]


def _captured(step):
    """``(CUDA graph, None)`` of one call of ``step`` captured on a stream of its own, or
    ``(None, the exception)`` where it could not be. The trainer is told a capture is under
    way (``fleetmpi.core.capture_checks``), so that it keeps its verdicts on the device as in
    ``fleet.graphed_step`` rather than reading them back, which CuPy refuses."""
    import cupy

    from fleetmpi.core import capture_checks

    stream = cupy.cuda.Stream(non_blocking=True)
    failure = graph = None
    with stream:
        try:
            stream.begin_capture()
        except Exception as exc:  # noqa: BLE001 - no capture here (HIP, an old driver)
            return None, exc
        try:
            with capture_checks.capturing(stream):
                step()
        except Exception as exc:  # noqa: BLE001 - a step that cannot be captured is reported
            failure = exc
        try:
            graph = stream.end_capture()
        except Exception as exc:  # noqa: BLE001 - the capture was invalidated
            failure = failure or exc
    return (None, failure) if failure is not None else (graph, None)


def count_kernels(step):
    """``(kernels, None)`` of one call of ``step`` captured into a CUDA graph, or ``(None,
    reason)`` where the capture or the count failed. The step's launches do not run: call it
    last, with nothing to measure after it."""
    graph, failure = _captured(step)
    if failure is not None:
        return None, f"the step does not capture ({_failure(failure)})"
    try:
        return graph_kernels(_driver(), ctypes.c_void_p(graph.graph)), None
    except (OSError, RuntimeError, AttributeError) as exc:
        return None, f"the captured graph was not counted ({_failure(exc)})"
