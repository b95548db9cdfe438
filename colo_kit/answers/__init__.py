"""Math500: notebook 05 (rewards and Math500).

- answer_check: is a completion's final answer the gold one (math-verify, with the cases it misses)
- math500: the checker as a process pool the reward calls, with a time limit per answer
- math500_eval: a model's accuracy on MATH-500 or the offline set; `colo-kit eval-math500`
"""
