"""gumiho.hostsync: the host-sync counter names a site outside a POSIX path, sees what
blocks the host on CUDA though a CPU run hides it, and `static` refuses such a step."""

import pytest
import torch

from gumiho.errors import GumihoError
from gumiho.graphs import StaticStep
from gumiho.hostsync import HostSyncCounter


@pytest.mark.host
@pytest.mark.parametrize("filename", ["<stdin>", "<string>", r"C:\work\gumiho\sampling.py"])
def test_sync_counter_names_a_site_outside_a_posix_path(filename):
    """A sync asked for from a REPL (`<stdin>`), `python -c` (`<string>`) or a Windows path
    is counted and named, not an IndexError from the site's name (which also broke
    `static`'s refusal of a syncing step)."""
    code = compile("x.tolist()\n", filename, "exec")
    with HostSyncCounter() as syncs:
        exec(code, {"x": torch.arange(3)})
    assert syncs.total == 1
    (site,) = syncs.sites
    assert site.startswith("tolist() at ") and site.endswith(":1")
    if "\\" in filename:
        assert site == "tolist() at gumiho/sampling.py:1"


@pytest.mark.host
def test_sync_counter_sees_reads_and_uploads_a_cpu_run_hides():
    """What blocks the host on CUDA but ran unseen on a CPU: torch.equal and allclose
    (a bool read back), bincount and unique over a dim (output sizes read back), and a
    0-dim tensor made from Python data on a device (a pageable copy, as a list's is).
    A Python scalar in arithmetic, a CPU scalar tensor and scalar_tensor (a fill) are not."""
    x = torch.arange(4)
    device = x.device
    reads = [lambda: torch.equal(x, x), lambda: torch.allclose(x.float(), x.float()),
             lambda: torch.bincount(x), lambda: torch.unique(x, dim=0),
             lambda: torch.tensor(5, device=device), lambda: torch.as_tensor(5.0, device=device),
             lambda: x.new_tensor(5)]
    for i, read in enumerate(reads):
        with HostSyncCounter() as syncs:
            read()
        assert syncs.total == 1, (i, syncs.by_kind)
    with HostSyncCounter() as none:
        x + 1
        x + torch.tensor(1)  # a CPU scalar: a kernel argument on any device
        torch.scalar_tensor(3, device=device)
        x[torch.arange(2)] = torch.zeros(2, dtype=torch.long)
    assert none.total == 0, none.sites


@pytest.mark.host
def test_static_engine_refuses_a_scalar_uploaded_inside_a_step():
    """A CUDA capture fails on `torch.tensor(2.0, device=...)` inside a step (its copy from
    pageable memory synchronises); `static` refused the list form only."""
    step = StaticStep(lambda x: (x + torch.tensor(2.0, device=x.device),), "static")
    with pytest.raises(GumihoError, match="makes the host wait.*tensor from Python data"):
        step(torch.ones(2))
