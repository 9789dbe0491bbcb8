//! What each key does to the view's state.
use super::*;

impl App {
    pub fn on_key(&mut self, key: KeyEvent) -> Action {
        if key.kind == KeyEventKind::Release {
            return Action::None;
        }
        if key.modifiers.contains(KeyModifiers::CONTROL) && key.code == KeyCode::Char('c') {
            return Action::Quit;
        }
        if self.editing_filter {
            match key.code {
                KeyCode::Enter => self.editing_filter = false,
                KeyCode::Esc => {
                    self.editing_filter = false;
                    self.filter.clear();
                    self.recompute();
                }
                KeyCode::Backspace => {
                    self.filter.pop();
                    self.recompute();
                }
                KeyCode::Char(c) => {
                    self.filter.push(c);
                    for s in Screen::ALL {
                        self.selected[s.index()] = 0;
                    }
                    self.recompute();
                }
                _ => {}
            }
            return Action::None;
        }
        if self.help {
            self.help = false;
            return match key.code {
                KeyCode::Char('q') => Action::Quit,
                _ => Action::None,
            };
        }
        match key.code {
            KeyCode::Char('q') => return Action::Quit,
            KeyCode::Esc => {
                if self.detail.is_some() {
                    self.detail = None;
                } else if !self.filter.is_empty() {
                    self.filter.clear();
                    self.recompute();
                } else {
                    return Action::Quit;
                }
            }
            KeyCode::Char('?') | KeyCode::F(1) => self.help = true,
            KeyCode::Tab => self.switch_screen(true),
            KeyCode::BackTab => self.switch_screen(false),
            KeyCode::Char(c @ '1'..='5') => {
                let screens = self.screens();
                if let Some(s) = screens.get(c as usize - '1' as usize) {
                    self.screen = *s;
                    self.detail = None;
                }
            }
            KeyCode::Down | KeyCode::Char('j') => self.move_selection(1),
            KeyCode::Up | KeyCode::Char('k') => self.move_selection(-1),
            KeyCode::PageDown => self.move_selection(10),
            KeyCode::PageUp => self.move_selection(-10),
            KeyCode::Home | KeyCode::Char('g') => self.move_selection(isize::MIN / 2),
            KeyCode::End | KeyCode::Char('G') => self.move_selection(isize::MAX / 2),
            KeyCode::Enter | KeyCode::Right => self.enter(),
            KeyCode::Left | KeyCode::Backspace => self.detail = None,
            KeyCode::Char('s') => self.cycle_sort(),
            KeyCode::Char('/') => {
                self.editing_filter = true;
                self.filter.clear();
                self.recompute();
            }
            KeyCode::Char('p') | KeyCode::Char(' ') => self.toggle_pause(),
            KeyCode::Char('r') => self.reset_baseline(),
            KeyCode::Char('R') => self.clear_baseline(),
            KeyCode::Char('w') => return Action::Write,
            _ => {}
        }
        Action::None
    }

    pub(super) fn enter(&mut self) {
        match self.screen {
            Screen::Sites => {
                if self.detail.is_some() {
                    self.detail = None;
                } else if let Some(r) = self.current_site() {
                    self.selected_site = Some(r.id);
                    self.detail = Some(r.id);
                    self.detail_scroll = 0;
                }
            }
            Screen::Processes => {
                let sel = self.selected(Screen::Processes);
                let pid = sel
                    .checked_sub(1)
                    .and_then(|i| self.proc_rows().get(i).map(|r| r.pid));
                if pid.is_some() && pid == self.focus {
                    self.set_focus(None);
                } else {
                    self.set_focus(pid);
                }
            }
            _ => {}
        }
    }

    pub(super) fn cycle_sort(&mut self) {
        match self.screen {
            Screen::Timeline => return,
            Screen::Sites => self.site_sort = self.site_sort.next(),
            Screen::Sizes => self.size_sort = self.size_sort.next(),
            Screen::Functions => self.func_sort = self.func_sort.next(),
            Screen::Processes => self.proc_sort = self.proc_sort.next(),
        }
        self.selected[self.screen.index()] = 0;
        self.selected_site = None;
        self.selected_pid = None;
        self.reselect();
        self.status = format!("sorted by {}", self.sort_name().unwrap_or("-"));
    }

    pub(super) fn move_selection(&mut self, delta: isize) {
        if self.detail.is_some() {
            self.detail_scroll = self.detail_scroll.saturating_add_signed(delta);
            return;
        }
        let n = self.row_count(self.screen);
        let i = self.screen.index();
        let new = self.selected[i]
            .saturating_add_signed(delta)
            .min(n.saturating_sub(1));
        self.selected[i] = new;
        match self.screen {
            Screen::Sites => self.selected_site = self.site_rows().get(new).map(|r| r.id),
            Screen::Processes => {
                self.selected_pid = new
                    .checked_sub(1)
                    .and_then(|j| self.proc_rows().get(j).map(|r| r.pid))
            }
            _ => {}
        }
    }

    pub(super) fn switch_screen(&mut self, forward: bool) {
        let screens = self.screens();
        let i = screens.iter().position(|s| *s == self.screen).unwrap_or(0);
        let n = screens.len();
        let j = if forward {
            (i + 1) % n
        } else {
            (i + n - 1) % n
        };
        self.screen = screens[j];
        self.detail = None;
    }

    /// Sets the focus on one process (None: all), as Enter on the processes screen does.
    pub fn set_focus(&mut self, pid: Option<u32>) {
        self.focus = pid;
        self.selected[Screen::Sites.index()] = 0;
        self.selected_site = None;
        self.detail = None;
        self.recompute();
        self.status = match pid {
            Some(p) => format!("every screen shows pid {p} only"),
            None => "every screen shows all processes".into(),
        };
    }

    pub fn toggle_pause(&mut self) {
        self.paused = !self.paused;
        if self.paused {
            // No round numbers here: the header says which round is shown, and this line
            // stays while rounds go on.
            self.status = "paused: the figures stay, the kernel keeps counting".into();
        } else {
            self.shown = self.latest.clone();
            self.recompute();
            self.status = "resumed: the figures follow the trace again".into();
        }
    }

    /// From now on the figures count from what is on screen now.
    pub fn reset_baseline(&mut self) {
        self.baseline = Some(self.shown.clone());
        self.recompute();
        self.status = format!("figures since round {}", self.shown.round());
    }

    pub fn clear_baseline(&mut self) {
        self.baseline = None;
        self.recompute();
        self.status = "figures since the start".into();
    }
}
