"""What each of ringcomm's CUDA kernels computes, in numpy, written from the kernel's side:
the arguments exactly as a launch passes them (flat arrays, the scalars' own types, n).

The stand-in's ``RawKernel`` runs these (entry points named by ``PREFIXES``); ``tests/unit/test_kernels.py`` checks each against
the kernel's PTX signature and the references, and ``tests/gpu`` the real kernels against
the references on a GPU.
"""
import numpy as np

PREFIXES = ("reduce_", "divide_", "scale_f32", "adam_step_f32", "cast_f32_to_f16", "unscale_f16_to_f32",
            "find_nonfinite_f32", "sq_norm_partial_f32_f64", "ringcomm_probe")


def model(name, grid, block, a):
    """Carry out kernel ``name`` on numpy arguments ``a``."""
    f32 = np.float32
    with np.errstate(all="ignore"):
        if name == "ringcomm_probe":
            a[0][:block[0]] += f32(1)
            return
        if name.startswith("reduce_"):
            if name.startswith("reduce_out_"):  # out = a (op) b: model it on a copy of a
                out, first, inc, n = a
                acc, op = first.copy(), name.split("_")[2]
            else:
                acc, inc, n = a
                out, op = None, name.split("_")[1]
            if op in ("max", "min"):
                keep = acc > inc if op == "max" else acc < inc
                if acc.dtype.kind == "f":
                    keep |= np.isnan(acc)
                if acc.dtype == np.float16:
                    keep |= acc == inc
                acc[...] = np.where(keep, acc, inc)
            elif op in ("band", "bor", "bxor"):
                f = {"band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}[op]
                f(acc, inc, out=acc)
            else:
                f = np.add if op == "sum" else np.multiply
                if acc.dtype.kind == "i":
                    u = acc.dtype.str.replace("i", "u")
                    acc[...] = f(acc.view(u), inc.view(u)).view(acc.dtype)
                else:
                    c = f32 if acc.dtype == np.float16 else acc.dtype.type
                    acc[...] = f(acc.astype(c), inc.astype(c)).astype(acc.dtype)
            if out is not None:
                out[...] = acc
        elif name.startswith("divide_"):
            x, divisor, n = a
            c = f32 if x.dtype == np.float16 else x.dtype.type
            assert type(divisor) is c, f"{name}: divisor is {type(divisor).__name__}, not {c.__name__}"
            x[...] = (x.astype(c) / divisor).astype(x.dtype)
        elif name == "scale_f32":
            x, factor, n = a
            assert x.dtype == f32 and type(factor) is f32, f"{name}: {x.dtype} x, {type(factor).__name__} factor"
            x *= factor
        elif name == "adam_step_f32":
            (master, grad, m, v, wd, use_wd, b1, omb1, b2, omb2, step_size, bc2_sqrt, eps, n) = a
            assert grad.dtype == f32 and master.dtype == f32
            g = grad.copy()
            p = master.copy()
            if use_wd:
                g = g + wd * p
            mi = m * b1 + omb1 * g
            vi = v * b2 + (omb2 * g) * g
            p = p - step_size * (mi / (np.sqrt(vi) / bc2_sqrt + eps))
            m[...], v[...], master[...] = mi, vi, p
        elif name == "cast_f32_to_f16":
            src, dst, n = a
            dst[...] = src.astype(np.float16)
        elif name == "unscale_f16_to_f32":
            src, dst, loss_scale, flag, n = a
            assert src.dtype == np.float16 and dst.dtype == f32 and type(loss_scale) is f32
            dst[...] = src.astype(f32) / loss_scale
            flag[0] |= int(not np.isfinite(dst).all())
        elif name == "find_nonfinite_f32":
            x, flag, n = a
            assert x.dtype == f32
            flag[0] |= int(not np.isfinite(x).all())
        elif name == "sq_norm_partial_f32_f64":
            x, divisor, partial, n = a
            assert partial.size == grid[0]
            assert x.dtype == f32 and type(divisor) is f32 and partial.dtype == np.float64
            u = (x / divisor).astype(np.float64)
            which = (np.arange(x.size) // block[0]) % grid[0]
            partial[...] = np.bincount(which, weights=u * u, minlength=grid[0])
        else:
            raise AssertionError(f"no model for {name}")
    assert n == a[0].size, f"{name}: n={n} for {a[0].size} elements"
