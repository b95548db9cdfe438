"""Every notebook's exercises and break-it labs (notebooks 00-06): lab, the predict-then-run exercises whose
checks refuse wrong answers; pitfalls, each pitfall of the posts run live, broken and then fixed."""
