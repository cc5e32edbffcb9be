"""Tensor parallelism over torch.distributed: group.py sets up the process group,
sampling.py samples from a vocabulary split over the ranks without a token broadcast.
Import the submodules directly; this package imports nothing, so importing it never pulls in
Triton before TRITON_INTERPRET is set."""
