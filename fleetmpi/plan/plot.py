"""The predicted scaling curves as a PNG: efficiency against ranks, one panel per inter-node
link, one line per algorithm (matplotlib with the Agg backend, no display needed)."""
from ..core.extras import MissingExtra



def plot_scaling(curves, path, title):
    """Draw ``curves`` (``{link name: {algorithm: [Prediction, ...]}}``) into the PNG ``path``."""
    try:
        import matplotlib
    except ImportError:
        raise MissingExtra("--png (drawing the scaling curves)", "matplotlib",
                           "plan") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(curves), figsize=(4.2 * len(curves), 3.6), squeeze=False,
                             sharey=True)
    for ax, (link, by_algorithm) in zip(axes[0], curves.items()):
        for algorithm, predictions in by_algorithm.items():
            ax.plot([p.ranks for p in predictions], [100 * p.efficiency for p in predictions],
                    marker="o", markersize=3, label=algorithm)
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 105)
        ax.set_title(link, fontsize=9)
        ax.set_xlabel("ranks")
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("scaling efficiency (%)")
    axes[0][-1].legend(fontsize=8, loc="lower left")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
