"""The reference twins of the Triton kernels: `reference/twins/<family>.py` is the twin of
`kernels/<family>.py`, and each kernel wrapper names its twin in code (`kernels/twin.py`'s
`@twin(...)`, read back as `wrapper.twin`). A twin takes the kernel's arguments, is built only
from reference/ops.py and the other reference modules in plain torch, and rounds at exactly the
kernel's rounding points (where the kernel rounds on purpose, the twin copies it and says why).
Twins compute on the CPU and return the live rows only ([n, …]); the kernels leave padding rows
untouched. `iquestrt/ops_twins.py` adapts them to the runtime's op table (iquestrt/ops.py).
"""
