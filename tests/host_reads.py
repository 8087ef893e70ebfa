"""HostReads: the ops that read a tensor's values back to the host, recorded while they run
(on a GPU each one makes the host wait for the device). `.tolist()` and `.item()` on a CPU
tensor do not dispatch, so a CPU test that must catch them patches them too."""
from torch.utils._python_dispatch import TorchDispatchMode

# ops whose result (or its size) needs the values on the host
HOST_READS = {'aten._local_scalar_dense', 'aten.item', 'aten.nonzero', 'aten.masked_select',
              'aten.unique', 'aten._unique2', 'aten.unique_dim', 'aten.unique_consecutive',
              'aten.bincount', 'aten.repeat_interleave'}


class HostReads(TorchDispatchMode):
    "Records, in `found`, the ops of HOST_READS that run inside it."
    def __init__(self):
        super().__init__()
        self.found = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func.overloadpacket) in HOST_READS:
            self.found.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))
