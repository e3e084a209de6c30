"""Which role each worker of `pdserve up` starts in, from its role options (pure): --prefill
/ --decode, --roles with --workers, --colocated, or the host's default layout
(launcher/default_layout.py); and the names the workers get from their roles.
"""

from __future__ import annotations

from collections.abc import Sequence

from protocol.messages import Role


def worker_roles(num_prefill: int | None, num_decode: int | None, colocated: bool,
                 num_workers: int | None, roles: str | None,
                 default: Sequence[Role] = (Role.PREFILL, Role.DECODE)) -> list[Role]:
    """The role each worker to start starts in, from --prefill/--decode, --colocated or
    --roles (with --workers); None is an option not given. Side-effect free; raises
    ValueError with a message for the user.

    no role option          →  `default` (launcher/default_layout.py: what wins on the host)
    --prefill N --decode M  →  N × PREFILL + M × DECODE (either alone: the other is 1)
    --roles R1,...,Rk       →  R1, ..., Rk (--workers K with one role: K of it; with k
                               roles, K == k)
    --colocated             →  --roles colocated (two workers unless --workers says)
    """
    if roles is not None and colocated:
        raise ValueError("--roles conflicts with --colocated (--colocated is the same as "
                         "--roles colocated)")
    grouped = "--roles" if roles is not None else "--colocated" if colocated else None
    if grouped is None and num_prefill is None and num_decode is None and num_workers is None:
        chosen = list(default)
    elif grouped is None:
        if num_workers is not None:
            raise ValueError("--workers counts the workers of --roles or --colocated; "
                             "use --prefill / --decode without them")
        counts = {"--prefill": 1 if num_prefill is None else num_prefill,
                  "--decode": 1 if num_decode is None else num_decode}
        for option, count in counts.items():
            if count < 0:
                raise ValueError(f"{option} must be >= 0")
        chosen = [Role.PREFILL] * counts["--prefill"] + [Role.DECODE] * counts["--decode"]
    else:
        if num_prefill is not None or num_decode is not None:
            raise ValueError(f"--prefill / --decode conflict with {grouped}: give the "
                             f"workers' roles with --roles (e.g. --roles prefill,decode)")
        names = parse_roles(roles) if roles is not None else [Role.COLOCATED]
        if num_workers is None:
            num_workers = len(names) if len(names) > 1 else 2
        if num_workers < 1:
            raise ValueError("--workers must be at least 1")
        if len(names) == 1:
            names = names * num_workers
        elif len(names) != num_workers:
            raise ValueError(f"--roles lists {len(names)} roles but --workers is "
                             f"{num_workers}: give one role for all workers or exactly "
                             f"{num_workers}")
        chosen = names
    if not any(role.decodes for role in chosen):
        raise ValueError("at least one worker that decodes is needed: decode, both or "
                         "colocated (--decode, --roles or --colocated)")
    return chosen


def parse_roles(text: str) -> list[Role]:
    choices = [role.value for role in Role]
    names = [name.strip() for name in text.split(",")]
    for name in names:
        if name not in choices:
            raise ValueError(f"--roles: unknown role {name!r} (roles: {', '.join(choices)})"
                             if name else f"--roles: an empty role in {text!r}")
    return [Role(name) for name in names]


def worker_names(roles: Sequence[Role]) -> list[str]:
    """"ROLE-INDEX" per worker, counted per role; the cluster's worker ids are these plus
    "-TAG"."""
    counts: dict[Role, int] = {}
    names = []
    for role in roles:
        names.append(f"{role.value}-{counts.get(role, 0)}")
        counts[role] = counts.get(role, 0) + 1
    return names


def parse_sizes_by_role(option: str, text: str | None, roles: Sequence[Role]) -> list[int]:
    """Each worker's group size from `option`'s value (side-effect free): one size for every
    worker ("2"), or sizes by role ("prefill=2,decode=1"; a role not named gets 1). None
    (not given): 1 each. Raises ValueError with a message for the user."""
    if text is None:
        return [1] * len(roles)
    by_role: dict[Role, int] = {}
    if "=" not in text:
        by_role = {role: _size(option, text) for role in Role}
    else:
        choices = {role.value: role for role in Role}
        for item in text.split(","):
            name, _, size = item.partition("=")
            if not name.strip() or not size:
                raise ValueError(f"{option}: {item!r} is not ROLE=N (e.g. prefill=2,decode=1)")
            role = choices.get(name.strip())
            if role is None:
                raise ValueError(f"{option}: unknown role {name.strip()!r} (roles: "
                                 f"{', '.join(choices)})")
            if role in by_role:
                raise ValueError(f"{option}: {role.value} is given twice in {text!r}")
            by_role[role] = _size(option, size)
    return [by_role.get(role, 1) for role in roles]


def _size(option: str, text: str) -> int:
    try:
        size = int(text.strip())
    except ValueError:
        raise ValueError(f"{option}: {text!r} is not a whole number") from None
    if size < 1:
        raise ValueError(f"{option} must be at least 1, got {size}")
    return size
