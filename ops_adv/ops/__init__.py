"""One module per op: its runtime function (`ops_adv.<op>`) and its custom operator `ops_adv::<op>`.

Each builds on `ops_adv._op` (the checks every op shares, and `define`) and `ops_adv._dispatch`
(the table lookup); none imports another. The kernels are in `kernel_space/<op>/`.
"""
