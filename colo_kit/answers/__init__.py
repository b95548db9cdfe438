"""Math500 (notebook 05): the answer comparison (answer_check), the checker the reward calls under a deadline
(math500), and a model's accuracy (math500_eval, `colo-kit eval-math500`).
"""
