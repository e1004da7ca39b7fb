"""Solvers: the cheapest plan (one choice per candidate region) whose planned peak fits a budget.

Pure functions over the cost model's `RegionModel` (per region and choice: bytes freed, recompute cost,
recomputation spike; per prefix of regions: the bytes that must be freed); they know nothing about graphs.
`solve` picks one by name (`SOLVERS`): an exact DP over a chain of regions, a MILP (HiGHS) for any graph,
or a greedy upgrade by bytes per cost. Ties in cost go to the lower planned peak (`tie_break`).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from fxmem.costmodel import RegionModel

CHOICES = ("keep", "selective", "full", "redraw")  # a region's choices, from no recomputation to the most


@dataclass
class Solution:
    plan: list[str]
    cost: float
    peak: int
    solver: str
    optimal: bool = True
    gap: float | None = None  # relative gap to a lower bound (greedy fallback)
    seconds: float = 0.0
    note: str = ""


def with_need(model: RegionModel, act_need: int) -> RegionModel:
    """`model` with the regions' total freed bytes bounded below by `act_need` (an activation budget)."""
    return model if model.act_need == act_need else replace(model, act_need=act_need)


def solve_dp(model: RegionModel, budget: int, units: int = 4096) -> list[str] | None:
    """Exact DP over the chain of regions; bytes quantised to need/units units (freed rounded down, needs up)."""
    needs = model.needs(budget)
    spikes = model.spike_needs(budget)
    top = max(needs + [v for d in spikes for v in d.values()])
    count = len(model.regions)
    if top == 0:
        return ["keep"] * count
    if needs[0] > 0:
        return None
    unit = max(1.0, top / units)
    cap = int(math.ceil(top / unit))
    need_units = [int(math.ceil(x / unit)) for x in needs]
    cheapest = np.full(cap + 1, math.inf)  # freed units (capped) -> least cost of the regions so far
    cheapest[0] = 0.0
    back = []
    for index, (region, choices) in enumerate(zip(model.regions, model.choices)):
        cheapest, step = _dp_step(cheapest, region, choices, spikes[index], unit, cap)
        cheapest[: need_units[index + 1]] = math.inf  # prefix constraint after this region
        back.append(step)
    if not np.isfinite(cheapest).any():
        return None
    # cheapest; among equal cost the most freed (lower peak)
    best = float(cheapest[np.isfinite(cheapest)].min())
    state = int(np.nonzero(cheapest <= best + 1e-9 * max(1.0, abs(best)))[0].max())
    plan = []
    for index in range(count - 1, -1, -1):
        choice_at, source = back[index]
        plan.append(model.choices[index][int(choice_at[state])])
        state = int(source[state])
    return plan[::-1]


def _dp_step(cheapest, region, choices, spikes: dict, unit: float, cap: int):
    """One region of `solve_dp`: the least cost per freed state after it, and per state the choice and source."""
    new = np.full(cap + 1, math.inf)
    choice_at = np.full(cap + 1, -1, dtype=np.int64)
    source = np.full(cap + 1, -1, dtype=np.int64)
    for choice_index, choice in enumerate(choices):
        freed = int(region.freed(choice) // unit)
        candidate = cheapest + region.cost(choice)
        if choice in spikes:  # its recomputation: the regions before it must free this much
            candidate[:int(math.ceil(spikes[choice] / unit))] = math.inf
        moved = np.full(cap + 1, math.inf)
        moved_from = np.full(cap + 1, -1, dtype=np.int64)
        low = max(0, cap - freed)  # states s < low move to s + freed < cap; the rest saturate at cap
        moved[freed:freed + low] = candidate[:low]
        moved_from[freed:freed + low] = np.arange(low)
        best = int(np.argmin(candidate[low:]))
        if candidate[low + best] < moved[cap]:
            moved[cap], moved_from[cap] = candidate[low + best], low + best
        better = moved < new - 1e-12 * np.maximum(1.0, np.abs(np.where(np.isfinite(new), new, 0.0)))
        new = np.where(better, moved, new)
        choice_at = np.where(better, choice_index, choice_at)
        source = np.where(better, moved_from, source)
    return new, (choice_at, source)


def _solve_dp_fine(model: RegionModel, budget: int) -> list[str] | None:
    """`solve_dp`; when it finds nothing although a plan fits (the plan freeing the most, or `lowest`'s when
    recomputation spikes bind), again on units fine enough that rounding cannot hide a plan (each region's freed
    bytes round down by up to a unit, so n regions can lose n units). Else that plan."""
    plan = solve_dp(model, budget)
    if plan is not None or not model.regions:
        return plan
    fits = next((p for p in (model.max_plan(), lowest(model)[1] if model.spike_base else None)
                 if p is not None and model.fits(p, budget)), None)
    if fits is None:
        return None
    return solve_dp(model, budget, units=4096 * len(model.regions)) or fits


def lowest(model: RegionModel) -> tuple[int, list[str]]:
    """(the lowest planned peak of any plan, a plan with it). With recomputation spikes, recomputing a region can
    raise the peak at its backward, so it is the lowest budget some plan fits: the DP's feasibility, bisected (its
    bytes rounded in the safe direction). Found once per model (kept in `model.memo`)."""
    if "lowest" not in model.memo:
        top_plan = model.max_plan()
        best = (model.peak(top_plan), top_plan)
        # (when no spike raises that plan's peak it is the lowest: no plan peaks below it without spikes)
        if best[0] > model.peak(top_plan, spikes=False):
            peak_only = replace(model, act_need=0, memo={})
            low, high = max(model.floor, model.live_by_prefix[0]), best[0]
            while high - low > max(1, high // 2048):
                mid = (low + high) // 2
                plan = solve_dp(peak_only, mid, units=1024)
                if plan is not None:
                    best = min(best, (model.peak(plan), plan))
                    high = min(mid, best[0])
                else:
                    low = mid + 1
        model.memo["lowest"] = best
    return model.memo["lowest"]


class _MilpLayout:
    """The 0/1 variables of a plan (one per region and allowed choice) and the matrices both MILPs use."""

    def __init__(self, model: RegionModel):
        count = len(model.regions)
        self.count = count
        self.var = [(index, choice) for index in range(count) for choice in model.choices[index]]
        columns = len(self.var)
        self.cost = np.array([model.regions[i].cost(c) for i, c in self.var])
        self.one = np.zeros((count, columns))  # row i: region i takes exactly one choice
        self.freed = np.zeros((count + 1, columns))  # row k: bytes freed by regions[:k]
        for column, (index, choice) in enumerate(self.var):
            self.one[index, column] = 1.0
            self.freed[index + 1:, column] = model.regions[index].freed(choice)

    def plan(self, values) -> list[str]:
        out = ["keep"] * self.count
        for column, (index, choice) in enumerate(self.var):
            if values[column] > 0.5:
                out[index] = choice
        return out


@dataclass
class _MilpProblem:
    """min cost.x subject to row_lo <= matrix x <= row_hi, col_lo <= x <= col_hi, x[integer] integral."""
    cost: np.ndarray
    matrix: np.ndarray
    row_lo: np.ndarray
    row_hi: np.ndarray
    col_lo: np.ndarray
    col_hi: np.ndarray
    integer: list


def highs_milp(cost, matrix, row_lo, row_hi, col_lo, col_hi, integer, time_limit: float):
    """min cost.x subject to row_lo <= matrix x <= row_hi, col_lo <= x <= col_hi, x[integer] integral: HiGHS
    through highspy (imported here: it is only needed when a MILP is solved). Returns (x or None, proven optimal,
    dual bound): x is the best feasible point found, the dual bound a lower bound on the optimum (the optimum
    itself when proven; at least the LP relaxation's bound otherwise), None when unknown. Shared with
    benchmarks/eager_floor.py."""
    import highspy
    # the binding itself: the Python wrapper's constructor enables callbacks, which prints HiGHS's banner to the
    # process's stdout before output_flag can be set (highspy 1.16)
    highs = getattr(highspy, "_Highs", highspy.Highs)()
    highs.setOptionValue("output_flag", False)
    highs.setOptionValue("time_limit", float(time_limit))
    highs.passModel(_highs_lp(highspy, _MilpProblem(cost, np.asarray(matrix, dtype=float), row_lo, row_hi, col_lo,
                                                    col_hi, integer)))
    highs.run()
    status, info = highs.getModelStatus(), highs.getInfo()
    optimal = status == highspy.HighsModelStatus.kOptimal
    feasible = info.primal_solution_status == highspy.SolutionStatus.kSolutionStatusFeasible
    values = np.array(highs.getSolution().col_value) if feasible else None
    bound = None
    if optimal:
        bound = float(info.objective_function_value)
    elif status == highspy.HighsModelStatus.kTimeLimit and math.isfinite(info.mip_dual_bound):
        bound = float(info.mip_dual_bound)
    return values, optimal, bound


def _highs_lp(highspy, problem: _MilpProblem):
    """`problem` as a HighsLp (the matrix column by column)."""
    matrix = problem.matrix
    col, row = np.nonzero(matrix.T)  # the nonzeros column by column
    linear_program = highspy.HighsLp()
    linear_program.num_col_, linear_program.num_row_ = matrix.shape[1], matrix.shape[0]
    linear_program.col_cost_ = np.asarray(problem.cost, dtype=float)
    linear_program.col_lower_ = np.asarray(problem.col_lo, dtype=float)
    linear_program.col_upper_ = np.asarray(problem.col_hi, dtype=float)
    linear_program.row_lower_ = np.asarray(problem.row_lo, dtype=float)
    linear_program.row_upper_ = np.asarray(problem.row_hi, dtype=float)
    linear_program.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    starts = np.r_[0, np.cumsum(np.bincount(col, minlength=matrix.shape[1]))]
    linear_program.a_matrix_.start_ = starts.astype(np.int32)
    linear_program.a_matrix_.index_ = row.astype(np.int32)
    linear_program.a_matrix_.value_ = matrix.T[col, row]
    kind = highspy.HighsVarType
    linear_program.integrality_ = [kind.kInteger if i else kind.kContinuous for i in problem.integer]
    return linear_program


def solve_milp(model: RegionModel, budget: int, time_limit: float):
    """The cheapest plan under `budget` as a MILP (HiGHS). Returns (plan or None, proven optimal, lower bound on
    the optimal cost or None): the bound is the optimum when proven, HiGHS's dual bound when the time limit
    stopped it, the LP relaxation's optimum when it stopped before having one (what a greedy plan's optimality
    gap is measured against)."""
    needs = model.needs(budget)
    if needs[0] > 0:  # above the budget before any region: nothing can help (as solve_dp)
        return None, True, None
    spikes = model.spike_needs(budget)
    layout = _MilpLayout(model)
    columns = len(layout.var)
    scale = max(1.0, layout.cost.max())
    byte_scale = max(1.0, max(needs + [v for d in spikes for v in d.values()]))
    binding = [k for k in range(1, layout.count + 1) if needs[k] > 0]  # prefix k: freed(regions[:k]) >= need[k]
    # region k recomputed with choice c: freed(regions[:k]) >= its spike's need, i.e. freed - need * x[k, c] >= 0
    column_of = {v: j for j, v in enumerate(layout.var)}
    spike_rows = []
    for index, by_choice in enumerate(spikes):
        for choice, need in by_choice.items():
            row = layout.freed[index].copy()
            row[column_of[(index, choice)]] -= need
            spike_rows.append(row)
    matrix = np.vstack([layout.one, layout.freed[binding] / byte_scale]
                       + [np.array(spike_rows) / byte_scale] * bool(spike_rows))
    row_lo = np.r_[np.ones(layout.count), np.array([needs[k] for k in binding], dtype=float) / byte_scale,
                   np.zeros(len(spike_rows))]
    row_hi = np.r_[np.ones(layout.count), np.full(len(binding) + len(spike_rows), np.inf)]
    zeros, ones = np.zeros(columns), np.ones(columns)
    values, optimal, bound = highs_milp(layout.cost / scale, matrix, row_lo, row_hi, zeros, ones,
                                        [True] * columns, time_limit)
    if bound is None:  # stopped before HiGHS had a bound: the LP relaxation's optimum is one (an LP solves fast)
        _, lp_optimal, lp_bound = highs_milp(layout.cost / scale, matrix, row_lo, row_hi, zeros, ones,
                                             [False] * columns, math.inf)
        bound = lp_bound if lp_optimal else None
    bound = bound * scale if bound is not None else None
    if values is None:
        return None, False, bound
    return layout.plan(values), optimal, bound


def milp_lowest_peak(model: RegionModel, plan: list[str], time_limit: float) -> list[str]:
    """Among plans no costlier than `plan`, one with the lowest planned peak: one MILP (minimise P subject to
    live[k] - freed(regions[:k]) <= P for every prefix k and cost <= plan's), not a bisection over budgets."""
    layout = _MilpLayout(model)
    count, columns = layout.count, len(layout.var)
    plan_cost, plan_peak = model.cost(plan), model.peak(plan)
    cost_scale = max(1.0, layout.cost.max())
    byte_scale = float(max(1, plan_peak))
    # columns: the plan's variables, then P; rows: one choice per region, no costlier (a relative tolerance: the
    # solver's own is about 1e-6), then P + freed(regions[:k]) >= live[k] for every prefix k, then the bytes all
    # regions free >= the activation need
    matrix = np.zeros((count + 1 + count + 1 + 1, columns + 1))
    matrix[:count, :columns] = layout.one
    matrix[count, :columns] = layout.cost / cost_scale
    matrix[count + 1:2 * count + 2, :columns] = layout.freed / byte_scale
    matrix[count + 1:2 * count + 2, columns] = 1.0
    matrix[2 * count + 2, :columns] = layout.freed[count] / byte_scale
    row_lo = np.r_[np.ones(count), -np.inf, np.array(model.live_by_prefix, dtype=float) / byte_scale,
                   model.act_need / byte_scale]
    row_hi = np.r_[np.ones(count), plan_cost / cost_scale * (1 + 1e-7) + 1e-9, np.full(count + 2, np.inf)]
    spike_rows = _spike_peak_rows(model, layout, byte_scale)
    if spike_rows:
        matrix = np.vstack([matrix, np.array(spike_rows)])
        row_lo = np.r_[row_lo, np.zeros(len(spike_rows))]
        row_hi = np.r_[row_hi, np.full(len(spike_rows), np.inf)]
    objective = np.zeros(columns + 1)
    objective[columns] = 1.0
    values, _, _ = highs_milp(objective, matrix, row_lo, row_hi,
                              np.r_[np.zeros(columns), model.floor / byte_scale], np.r_[np.ones(columns), np.inf],
                              [True] * columns + [False], time_limit)
    if values is None:
        return plan
    out = layout.plan(values)
    # the solver's tolerances must not make the plan costlier, its peak higher or its freed bytes short
    if model.cost(out) <= plan_cost * (1 + 1e-9) + 1e-9 and model.peak(out) <= plan_peak \
            and model.freed(out) >= model.act_need:
        return out
    return plan


def _spike_peak_rows(model: RegionModel, layout: _MilpLayout, byte_scale: float) -> list:
    """Rows of `milp_lowest_peak`: region k recomputed with choice c: P + freed(regions[:k]) - (spike base +
    spike) * x[k, c] >= 0."""
    columns = len(layout.var)
    rows = []
    for column, (index, choice) in enumerate(layout.var):
        extra = model.regions[index].spike.get(choice, 0) \
            if choice != "keep" and index < len(model.spike_base) else 0
        if extra > 0:
            row = np.zeros(columns + 1)
            row[:columns] = layout.freed[index] / byte_scale
            row[column] -= (model.spike_base[index] + extra) / byte_scale
            row[columns] = 1.0
            rows.append(row)
    return rows


def solve_greedy(model: RegionModel, budget: int) -> list[str] | None:
    """Upgrade the region with the best bytes-freed per unit cost until the plan fits (nested by budget)."""
    plan = ["keep"] * len(model.regions)
    rank = {c: i for i, c in enumerate(CHOICES)}
    while not model.fits(plan, budget):
        best, best_ratio = None, -1.0
        for index, (region, choices) in enumerate(zip(model.regions, model.choices)):
            for choice in choices:
                if rank[choice] <= rank[plan[index]]:
                    continue
                more_freed = region.freed(choice) - region.freed(plan[index])
                if more_freed <= 0:
                    continue
                more_cost = region.cost(choice) - region.cost(plan[index])
                ratio = more_freed / max(more_cost, 1e-9)
                if ratio > best_ratio:
                    best, best_ratio = (index, choice), ratio
        if best is None:
            return None
        plan[best[0]] = best[1]
    return plan


def _lowest_peak_same_cost(model: RegionModel, plan: list[str], budget: int, iters: int = 24) -> list[str]:
    """Among plans with the optimal cost, one with the lowest planned peak (DP, bisection on the budget)."""
    plan_cost = model.cost(plan)
    low, high = model.min_peak(), model.peak(plan)
    best = plan
    for _ in range(iters):
        if high - low <= max(1, high // 4096):
            break
        mid = (low + high) // 2
        found = solve_dp(model, mid)
        if found is not None and model.cost(found) <= plan_cost * (1 + 1e-9) + 1e-9:
            best, high = found, min(model.peak(found), mid)
        else:
            low = mid + 1
    return best


def _gap(model: RegionModel, plan: list[str], bound: float | None) -> float | None:
    """The plan's relative gap to a lower bound on the optimal cost (None without a bound)."""
    return (model.cost(plan) - bound) / max(bound, 1e-12) if bound else None


def _by_dp(model: RegionModel, budget: int, time_limit: float, tiebreak: bool) -> Solution | None:
    plan = _solve_dp_fine(model, budget)
    if plan is not None and tiebreak:
        # lexicographic tie-break: the lowest budget with the same cost gives the lowest peak
        plan = _lowest_peak_same_cost(model, plan, budget)
    return None if plan is None else Solution(plan, model.cost(plan), model.peak(plan), "dp")


def _by_milp(model: RegionModel, budget: int, time_limit: float, tiebreak: bool) -> Solution | None:
    """HiGHS; when it proves no optimum in `time_limit`, the greedy plan if cheaper, with its gap to HiGHS's bound."""
    plan, optimal, bound = solve_milp(model, budget, time_limit)
    solver, note, gap = "milp", "", None
    if plan is not None and optimal and tiebreak:
        plan = milp_lowest_peak(model, plan, time_limit)
    if plan is None or not optimal:
        greedy = solve_greedy(model, budget)
        if greedy is not None and (plan is None or model.cost(greedy) < model.cost(plan)):
            note = f"MILP found no proven optimum within time_limit={time_limit:g}s; greedy plan used"
            plan, solver = greedy, "greedy"
        if plan is not None:
            gap = _gap(model, plan, bound)
    if plan is None:
        return None
    return Solution(plan, model.cost(plan), model.peak(plan), solver, optimal, gap, note=note)


def _by_greedy(model: RegionModel, budget: int, time_limit: float, tiebreak: bool) -> Solution | None:
    """The greedy plan, with its gap to the MILP's optimum (or bound) when HiGHS finds one in `time_limit`."""
    plan = solve_greedy(model, budget)
    if plan is None:
        return None
    try:
        _, _, bound = solve_milp(model, budget, time_limit)  # the optimum, or a bound on it
    except Exception:  # noqa: BLE001 - the bound is informative only
        bound = None
    return Solution(plan, model.cost(plan), model.peak(plan), "greedy", False, _gap(model, plan, bound))


SOLVERS = {"dp": _by_dp, "milp": _by_milp, "greedy": _by_greedy}


def solve(model: RegionModel, budget: int, solver: str, time_limit: float, chain: bool,
          tiebreak: bool = True) -> Solution | None:
    """The cheapest plan under `budget` by the solver named (`auto`: dp for a chain of regions, milp otherwise);
    with `tiebreak`, among the cheapest the one with the lowest planned peak (see `tie_break`)."""
    started = time.perf_counter()
    name = solver if solver != "auto" else ("dp" if chain else "milp")
    if name not in SOLVERS:
        raise ValueError(f"unknown checkpoint solver {solver!r}: one of auto, {', '.join(SOLVERS)}")
    found = SOLVERS[name](model, budget, time_limit, tiebreak)
    return None if found is None else replace(found, seconds=time.perf_counter() - started)


def tie_break(sol: Solution, model: RegionModel, budget: int, time_limit: float) -> Solution:
    """`sol` (found with tiebreak=False) replaced by a plan of the same cost with the lowest planned peak."""
    if sol.solver == "dp":
        plan = _lowest_peak_same_cost(model, sol.plan, budget)
    elif sol.solver == "milp" and sol.optimal:
        plan = milp_lowest_peak(model, sol.plan, time_limit)
    else:
        return sol
    return Solution(plan, model.cost(plan), model.peak(plan), sol.solver, sol.optimal, sol.gap, sol.seconds,
                    sol.note)
