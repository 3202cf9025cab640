"""Optimizer wrappers: convergence to the centralized least-squares solution at 4 agents,
and the per-parameter update rules of ATC against torch.optim itself."""
import pytest
import torch

from bluefog_lite import _local_steps
from mpi_helpers import Batch, run_agents

# Where a GPU is, the rules are checked on CUDA tensors too, against torch's CUDA
# optimizers (its multi-tensor forms there: the same math in another order of rounding);
# elsewhere those cases are not generated (tests/test_devices.py's CUDA test is the skipped one)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

CASES = [("awc", "nar"), ("awc", "dyn"), ("awc", "ar"), ("awc", "empty"),
         ("atc", "nar"), ("atc", "dyn"), ("atc", "ar"), ("atc", "empty"), ("gar", "-")]


# the workers of one agent count without arguments or environment of their own, one job for each count
OPT4 = Batch(4, {**{w: (w,) for w in ("opt_failed_steps.py", "opt_transforms.py", "opt_forward_changes.py",
                                      "opt_closure.py", "opt_subset.py", "opt_skipped_step.py", "opt_parametrized.py",
                                      "opt_frozen.py", "opt_between_steps.py", "opt_period.py")},
                 **{f"opt_recover.py-{w}": ("opt_recover.py", w) for w in ("awc", "atc")}}, timeout=900)
OPT2 = Batch(2, {w: (w,) for w in ("opt_dropped.py", "opt_arguments.py", "opt_accumulate.py")}, timeout=300)
# tests/workers/opt_linear.py's cases, in one job (mpi_helpers.Batch: a launch costs more than a case)
LINEAR = Batch(4, {**{f"{w}-{c}-sgd": ("opt_linear.py", w, c, "sgd") for w, c in CASES},
                   **{f"winput-{how}": ("opt_linear.py", "winput", "-", "sgd", how) for how in ("loop", "closure")},
                   "gar-adam": ("opt_linear.py", "gar", "-", "adam")}, timeout=600)


@pytest.mark.parametrize("wrapper,comm", CASES)
def test_sgd_wrappers_reach_centralized_solution(wrapper, comm):
    """Relative error < 2e-2 for every communicating variant; > 0.2 without communication."""
    LINEAR.check(f"{wrapper}-{comm}-sgd")


def test_a_dropped_wrapper_and_its_model_are_freed():
    """tests/workers/opt_dropped.py: ATC's and gradient allreduce's gradient hooks kept
    every wrapper built and dropped alive, with its model, gradients and optimizer state;
    one dropped while its model is kept lives as long as the model, on every agent."""
    OPT2.check("opt_dropped.py")


@pytest.mark.parametrize("how", ["loop", "closure"])
def test_win_put_optimizer_reaches_a_neighborhood(how):
    """Asynchronous, neighbor values up to 10 steps stale (a barrier every 10 steps keeps
    the agents' step rates equal): relative error < 2e-2, as the synchronous wrappers."""
    LINEAR.check(f"winput-{how}")


def test_machine_knobs_under_bluefogs_names_steer_hierarchical_awc():
    """neighbor_machine_weights / send_neighbor_machines set on the wrapper reach the
    hierarchical communication (2 emulated machines of 2 agents), checked against numpy."""
    run_agents(4, "opt_machine_knobs.py", timeout=90, env={"BLUEFOG_RANKS_PER_MACHINE": "2"})


def test_bluefog_forms_and_plain_optimizer_equivalence(tmp_path):
    """ATC steps parameters whose gradient this pass did not produce, refuses a subclass
    with its own step() until its rule is registered (Bluefog's opt.register_step_function),
    keeps a scheduler on its base optimizer quiet; WinPut combines once after
    synchronize(), has force_barrier/window_prefix/unregister_window; turn_off_timeline()
    stops FORWARD spans; state-dict hooks registered on a wrapper run
    (tests/workers/opt_bluefog_forms.py, against torch.optim)."""
    run_agents(1, "opt_bluefog_forms.py", timeout=90, env={"BLUEFOG_TIMELINE": str(tmp_path / "t")})


def test_training_goes_on_after_a_step_failed_on_every_agent():
    """A retried step inside skip_synchronize() (AWC, gradient allreduce) and a batch
    skipped after ATC's backward raised partway match runs without the failure
    (tests/workers/opt_failed_steps.py)."""
    OPT4.check("opt_failed_steps.py")


def test_passes_inside_torch_func_transforms_start_nothing():
    """Per-sample gradients (vmap(grad(functional_call))) and an input gradient between
    steps leave every wrapper's results as without them (tests/workers/opt_transforms.py)."""
    OPT4.check("opt_transforms.py")


def test_compiled_models_train_as_uncompiled_ones_without_warnings(tmp_path):
    """torch.compile'd before or after wrapping, timeline on: AWC (both kinds), ATC and
    gradient allreduce give the uncompiled loop's parameters, and Dynamo does not trace
    (and warn about) the wrappers' and the timeline's hooks (tests/workers/opt_compiled.py)."""
    run_agents(2, "opt_compiled.py", timeout=150, env={"BLUEFOG_TIMELINE": str(tmp_path / "t")})


def test_parameters_the_forward_pass_changes_or_skips_are_communicated_whole():
    """lr 0 against the mixing matrix: an nn.Embedding(max_norm) called twice per pass is
    averaged as the pass left it (its communication was changed in flight), a subclass too,
    and with allreduce it comes last in the fixed order, holding none back; WinPut puts
    MultiheadAttention's out_proj (never called as a module) in the forward pass, so
    its neighbors' values of the step are combined (tests/workers/opt_forward_changes.py)."""
    OPT4.check("opt_forward_changes.py")


def test_step_with_closure_equals_an_explicit_pass():
    """AWC, ATC and gradient allreduce: step(closure) gives the same parameters and
    losses as zero_grad/forward/backward/step() (the closure's communication completes
    in its own step)."""
    OPT4.check("opt_closure.py")


BRANCH_CASES = [("gar", "ar"), ("awc", "ar"), ("atc", "ar"), ("awc", "nar"), ("atc", "nar"), ("awc", "ar_set"),
                ("atc", "ar_set"), ("awc", "dyn"), ("atc", "dyn")]
BRANCHES = Batch(4, {f"{w}-{c}": ("opt_branches.py", w, c) for w, c in BRANCH_CASES}, timeout=600)


@pytest.mark.parametrize("wrapper,comm", BRANCH_CASES)
def test_wrappers_with_data_dependent_branches_match_a_simulation(wrapper, comm):
    """Agents take different branches of the model (and none takes one of them): the
    allreduces still line up, synchronize() before step() starts the unused parameters
    too, and the parameters equal a plain-torch simulation. ar_set: allreduce set with
    the communication_type attribute after creation (as Bluefog allows). dyn: a dynamic
    one-peer step with enable_topo_check on (its check is a collective, matched by order)."""
    BRANCHES.check(f"{wrapper}-{comm}")


def test_gradient_allreduce_with_adam_is_exact():
    LINEAR.check("gar-adam")


@pytest.mark.parametrize("make", [
    lambda p: torch.optim.SGD(p, lr=0.1),
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01),
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
    lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=0.1),
    lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=0.1, amsgrad=True),
    lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1, amsgrad=True, maximize=True),
    lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
    lambda p: torch.optim.RMSprop(p, lr=0.01),
    lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.5, centered=True),
    lambda p: torch.optim.Adagrad(p, lr=0.1, lr_decay=0.01),
    lambda p: torch.optim.Adadelta(p, lr=1.0, weight_decay=0.01),
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01, maximize=True),
    lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=0.1, maximize=True),
    lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1, maximize=True),
    lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.5, centered=True, maximize=True),
    lambda p: torch.optim.Adagrad(p, lr=0.1, lr_decay=0.01, weight_decay=0.1, maximize=True),
    lambda p: torch.optim.Adadelta(p, lr=1.0, weight_decay=0.01, maximize=True),
])
@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128])
@pytest.mark.parametrize("device", DEVICES)
def test_per_parameter_step_matches_torch(make, dtype, device):
    """ATC's rule for one parameter gives torch's parameter and state. A complex
    parameter is stepped as its real and imaginary parts, as torch does (the rules took
    squares and roots in complex arithmetic: Adam was 0.08 off after a few steps)."""
    torch.manual_seed(0)
    a = torch.randn(7, dtype=dtype).to(device).requires_grad_()
    b = a.detach().clone()
    ref = make([a])
    group = dict(make([torch.zeros(1, requires_grad=True)]).param_groups[0])
    step = _local_steps.step_function_for(ref)
    state = {}
    for _ in range(6):
        g = torch.randn(7, dtype=dtype).to(device)
        a.grad = g.clone()
        ref.step()
        step(b, g, group, state)
    tol = 1e-12 if device == "cpu" else 1e-10
    torch.testing.assert_close(b, a.detach(), rtol=tol, atol=tol)
    theirs = ref.state[a]
    assert sorted(state) == sorted(theirs), (sorted(state), sorted(theirs))
    for key, value in theirs.items():    # (so that state_dict() moves between the two)
        torch.testing.assert_close(state[key], value, rtol=tol, atol=tol, msg=key)


@pytest.mark.filterwarnings("ignore:Sparse invariant checks are implicitly disabled")    # (torch's own Adagrad)
@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128])
@pytest.mark.parametrize("kwargs", [{}, {"lr_decay": 0.01, "maximize": True, "initial_accumulator_value": 0.1}])
@pytest.mark.parametrize("device", DEVICES)
def test_per_parameter_adagrad_takes_sparse_gradients_as_torch(kwargs, dtype, device):
    """Sparse gradients (nn.Embedding(sparse=True)) with Adagrad, torch's sparse optimizer:
    ATC's rule updates only the rows the gradient has, as torch does (it raised
    NotImplementedError inside backward), for a complex parameter in complex arithmetic as
    torch's sparse path; the rules whose torch optimizer refuses sparse gradients refuse
    them by name."""
    torch.manual_seed(0)
    a = torch.randn(10, 3, dtype=dtype).to(device).requires_grad_()
    mine = a.detach().clone()
    ref = torch.optim.Adagrad([a], lr=0.1, **kwargs)
    group = dict(torch.optim.Adagrad([torch.zeros(1, requires_grad=True)], lr=0.1, **kwargs).param_groups[0])
    step, state = _local_steps.step_function_for(ref), {}
    for _ in range(5):
        rows = torch.randint(0, 10, (6,))        # (repeated rows: coalesced, as torch's rule does)
        grad = torch.sparse_coo_tensor(rows.unsqueeze(0), torch.randn(6, 3, dtype=dtype), (10, 3),
                                       check_invariants=True).to(device)
        a.grad = grad.clone()
        ref.step()
        step(mine, grad, group, state)
    tol = 1e-12 if device == "cpu" else 1e-10
    torch.testing.assert_close(mine, a.detach(), rtol=tol, atol=tol)
    torch.testing.assert_close(state["sum"], ref.state[a]["sum"], rtol=tol, atol=tol)
    for make, name in ((torch.optim.Adam, "Adam"), (torch.optim.RMSprop, "RMSprop"),
                       (torch.optim.Adadelta, "Adadelta")):
        other = make([torch.zeros(10, 3, dtype=dtype, device=device, requires_grad=True)])
        with pytest.raises(TypeError, match=f"{name} does not take sparse gradients"):
            _local_steps.step_function_for(other)(mine, grad, dict(other.param_groups[0]), {})
    with pytest.raises(TypeError, match="sparse gradient only without weight_decay"):   # (as torch)
        step(mine, grad, dict(group, weight_decay=0.1), {})


def test_unsupported_optimizer_names_the_fix():
    opt = torch.optim.LBFGS([torch.zeros(1, requires_grad=True)])
    with pytest.raises(TypeError, match="register_step_function"):
        _local_steps.step_function_for(opt)


def test_wrapper_arguments_are_checked():
    """Each bad argument raises naming it; a sparse gradient in gradient allreduce is named."""
    OPT2.check("opt_arguments.py")


def test_an_optimizer_holding_part_of_the_model_trains_and_communicates_that_part():
    """As in Bluefog (a head fine-tuned on a backbone): the head against a simulation of
    each wrapper, the rest unmoved; the backbone added to the optimizer later is refused."""
    OPT4.check("opt_subset.py")


def test_a_step_function_must_take_four_arguments():
    with pytest.raises(TypeError, match=r"fn must take four arguments, fn\(param, grad, group, state\)"):
        _local_steps.register_step_function(torch.optim.RMSprop, lambda x: x)
    assert _local_steps.step_function_for(torch.optim.RMSprop([torch.zeros(1, requires_grad=True)])) \
        is _local_steps.rmsprop_step      # the refused one was not registered


@pytest.mark.parametrize("wrapper", ["awc", "atc"])
def test_a_wrapper_whose_step_failed_works_again_from_the_next_step(wrapper):
    """Bad weights for one step (the error caught): the next steps equal a fresh wrapper's."""
    OPT4.check(f"opt_recover.py-{wrapper}")


def test_synchronize_ends_the_round_when_step_is_skipped():
    """A gradient scaler's pattern (synchronize(), then step() skipped on overflow), on
    every agent or one: each wrapper goes on like a plain-torch simulation of the agents;
    gradient allreduce's zero_grad() without step() drops that pass's averages
    (tests/workers/opt_skipped_step.py)."""
    OPT4.check("opt_skipped_step.py")


def test_parametrized_layer():
    """AWC and WinPut mix weight_norm's parameters like the others (against the mixing
    matrix); reading the weight on one agent outside a pass starts no communication
    (tests/workers/opt_parametrized.py)."""
    OPT4.check("opt_parametrized.py")


def test_layer_frozen_after_wrapping_is_left_alone():
    """AWC, ATC (neighbor and allreduce) and WinPut stop sending and combining a layer
    frozen after their creation, as Bluefog does; the other layer goes on mixing like
    the mixing matrix says (tests/workers/opt_frozen.py)."""
    OPT4.check("opt_frozen.py")


def test_two_backward_passes_before_step():
    """AWC steps on the accumulated gradient; ATC raises rather than drop the second pass.
    Also: an optimizer parameter outside the model is stepped like torch.optim does."""
    OPT2.check("opt_accumulate.py")


def test_calls_between_steps_synchronize_winput_knobs_and_refused_state():
    """synchronize() right after step() on one agent changes nothing; WinPut refuses
    src_weights without self_weight; a refused load_state_dict loads nothing."""
    OPT4.check("opt_between_steps.py")


def test_communication_period_and_atc_hyper_parameters_after_load_state_dict():
    """num_steps_per_communication=3: steps 3, 6, ... communicate (x after step s is
    W^(s // 3) x0 with lr 0); ATC steps with param_groups as loaded and changed; every
    wrapper follows its optimizer reloaded (broadcast_optimizer_state) or given a new
    group after wrapping."""
    OPT4.check("opt_period.py")
