"""verl 0.9.1: `DataProto.from_dict` unpacks a non-tensor column whose rows are tensors of one shape.

`from_dict` turns each non-tensor column into `np.array(val, dtype=object)` (verl/protocol.py,
`DataProto.from_dict`). numpy reads a list of equal-shape tensors as a nested sequence, so the
column becomes a 2-D object array of scalars: row i is no longer the tensor the caller gave,
`len(column)` still equals the batch size, and `check_consistency` (which compares dim 0 only)
accepts it. Rows of different shapes stay tensors, so the result depends on the data.

Run: python verl-from-dict-tensor-rows.py  (needs verl 0.9.1, torch, numpy, tensordict)

Expected: column shape (2,), each row a torch.Tensor equal to the input row.
Actual (verl 0.9.1, numpy 2.x, torch 2.13): column shape (2, 3), row 0 a numpy.ndarray;
with one row, shape (1, 3).
"""

import torch
from verl.protocol import DataProto

for rows in ([torch.arange(3), torch.arange(3) + 10],   # equal shapes
             [torch.arange(3)],                          # one row
             [torch.arange(3), torch.arange(4)]):        # unequal shapes (kept as tensors)
    p = DataProto.from_dict(tensors={"input_ids": torch.zeros(len(rows), 2, dtype=torch.long)},
                            non_tensors={"per_sample": rows})
    p.check_consistency()
    col = p.non_tensor_batch["per_sample"]
    print(f"{len(rows)} rows of shapes {[tuple(r.shape) for r in rows]}: column shape "
          f"{col.shape}, row 0 is a {type(col[0]).__module__}.{type(col[0]).__name__}")
